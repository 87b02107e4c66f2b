"""`python -m s2s` runs the command line."""

from s2s.cli import run

if __name__ == "__main__":
    run()
