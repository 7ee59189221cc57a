"""`python -m spmd`: the `spmd` command line."""

from spmd.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
