"""`python -m s2s` runs the command line."""

from s2s.launch import main

if __name__ == "__main__":
    main()
