"""``python -m linearize.cli`` (as under ``torchrun``): the console script's entry point."""

from . import main

if __name__ == "__main__":
    main()
