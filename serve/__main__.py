"""`python -m serve ...` is `jaxlora-serve ...`."""

from serve.cli import main

main()
