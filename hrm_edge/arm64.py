"""`python -m hrm_edge.arm64`: fetches the ARM64 emulation toolchain (hrm_edge.verify.arm64_toolchain)."""
from hrm_edge.errors import run_cli
from hrm_edge.verify.arm64_toolchain import main

if __name__ == "__main__":
    run_cli(main)
