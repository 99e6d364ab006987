"""`python -m sparseconv ...` is the `sparseconv` command."""
from .cli import main

main(prog_name="sparseconv")
