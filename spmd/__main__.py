"""`python -m spmd`: the `spmd` command line."""

from spmd._src.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
