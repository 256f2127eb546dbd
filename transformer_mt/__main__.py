from transformer_mt.cli import run

run()
