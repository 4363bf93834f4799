"""`python -m hrm_edge.sysdeps`: installs the Debian packages the test suite needs (hrm_edge.verify.sysdeps)."""
from hrm_edge.errors import run_cli
from hrm_edge.verify.sysdeps import main

if __name__ == "__main__":
    run_cli(main)
