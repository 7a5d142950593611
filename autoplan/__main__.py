"""``python -m autoplan ...``: the same as the ``autoplan`` command."""

from autoplan.cli import main

if __name__ == "__main__":
    main()
