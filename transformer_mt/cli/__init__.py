"""The `tmt` command line: its parser and one module per group of commands; the only package that prints."""
