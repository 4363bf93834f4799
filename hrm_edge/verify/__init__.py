"""Verification: the parity gate (hrm_edge.verify.parity), the browser's parity bundle, ARM64 emulation, and the
Debian packages the test suite needs."""
