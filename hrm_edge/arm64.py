"""`python -m hrm_edge.arm64`: fetches the ARM64 emulation toolchain (hrm_edge.verify.arm64)."""
from hrm_edge.errors import run_cli
from hrm_edge.verify.arm64 import main

if __name__ == "__main__":
    run_cli(main)
