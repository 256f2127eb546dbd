from transformer_mt.cli.main import run

run()
