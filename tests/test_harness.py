"""The timing harness (hrm_edge.measure.harness): CPU record, peak RSS, the decode measurement's row, the child
protocol's failure, and the "build unless current" marker. Fast: no export."""
import resource

import numpy as np
import pytest

from hrm_edge.measure.harness import (DecodeTiming, build_unless_current, cpu_info, describe_cpu, measure_decode,
                                      peak_rss_mb, run_child)
from hrm_edge.errors import UserError
from hrm_edge.runtime.decoders import Decoder
from test_peers import BENCH_DECODE_KEYS

X86_CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 167
model name\t: Intel(R) Xeon(R) Processor
stepping\t: 8
flags\t\t: fpu sse2 avx avx2 avx512f avx512bw avx512_vnni avx_vnni amx_bf16 amx_tile amx_int8

processor\t: 1
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu
"""
ARM_CPUINFO = """processor\t: 0
BogoMIPS\t: 50.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm asimddp i8mm sve
CPU implementer\t: 0x41
"""


def cache_dir(root, caches):
    """A sysfs cache folder: index0.. with level, type, size, shared_cpu_list."""
    for i, (level, kind, size, shared) in enumerate(caches):
        d = root / f"index{i}"
        d.mkdir(parents=True)
        for name, value in (("level", level), ("type", kind), ("size", size), ("shared_cpu_list", shared)):
            (d / name).write_text(f"{value}\n")
    return root


def test_cpu_info_reads_x86_flags_and_caches(tmp_path):
    (tmp_path / "cpuinfo").write_text(X86_CPUINFO)
    caches = cache_dir(tmp_path / "cache", [(1, "Data", "48K", "0"), (1, "Instruction", "32K", "0"),
                                            (2, "Unified", "2048K", "0"), (3, "Unified", "107520K", "0-1")])
    info = cpu_info(1, tmp_path / "cpuinfo", caches)
    assert info["model"] == "Intel(R) Xeon(R) Processor" and info["family"] == "6/167/8"
    assert info["isa"] == ["avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8", "amx_bf16"]
    assert info["l2_bytes"] == 2 * 2**20 and info["l3_bytes"] == 105 * 2**20
    assert info["threads"] == 1 and info["cores"] >= 1
    line = describe_cpu(info | {"cores": 2})
    assert line == ("CPU: Intel(R) Xeon(R) Processor (family 6 model 167 stepping 8; AVX-512, VNNI, AMX), "
                    "L2 2 MiB/core, L3 105 MiB, 2 cores; 1 thread")
    no_family = describe_cpu(info | {"cores": 2, "family": None})
    assert no_family.startswith("CPU: Intel(R) Xeon(R) Processor (AVX-512, VNNI")


def test_cpu_info_reads_arm_features_and_survives_missing_files(tmp_path):
    (tmp_path / "cpuinfo").write_text(ARM_CPUINFO)
    caches = cache_dir(tmp_path / "cache", [(1, "Data", "64K", "0"), (2, "Unified", "1024K", "0")])
    info = cpu_info(None, tmp_path / "cpuinfo", caches)
    assert info["isa"] == ["asimd", "asimddp", "i8mm", "sve"] and "threads" not in info and info["family"] is None
    assert info["l2_bytes"] == 2**20 and info["l3_bytes"] is None
    assert describe_cpu(info | {"model": "Neoverse-V1", "cores": 4}) == \
        "CPU: Neoverse-V1 (NEON, dotprod, i8mm, SVE), L2 1 MiB/core, 4 cores"
    bare = cpu_info(2, tmp_path / "absent", tmp_path / "absent")
    assert bare["isa"] == [] and bare["l2_bytes"] is None and bare["model"]  # platform's name, never empty


def test_peak_rss_is_vmhwm_with_getrusage_where_proc_has_none(tmp_path):
    status = tmp_path / "status"
    status.write_text("Name:\tpython\nVmPeak:\t  900000 kB\nVmHWM:\t  204800 kB\nVmRSS:\t  102400 kB\n")
    assert peak_rss_mb(status) == 200.0
    status.write_text("Name:\tpython\n")  # no VmHWM line (not Linux's /proc)
    assert peak_rss_mb(status) == resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    assert peak_rss_mb(tmp_path / "absent") > 10  # this process, from getrusage
    assert peak_rss_mb() > 10  # this process, from /proc


class CountingDecoder(Decoder):
    """Logits [S, 8] that make greedy decoding pick token (last + 1) % 8; max_seq_len 64."""

    max_seq_len = 64

    def reset(self):
        self.pos = 0

    def _run(self, tokens):
        self.pos += len(tokens)
        return np.eye(8, dtype=np.float32)[(np.asarray(tokens) + 1) % 8]


def test_measure_decode_row_has_the_bench_keys_and_its_numbers():
    t = DecodeTiming(threads=1, prompt_len=5, new_tokens=9, repeats=3, weight_cache=False)
    row = measure_decode(CountingDecoder, "counting", t)
    assert set(row) == BENCH_DECODE_KEYS
    assert (row["artifact"], row["prompt_len"], row["new_tokens"], row["weight_cache"]) == ("counting", 5, 9, False)
    assert row["prefill_tokens_per_s"] == pytest.approx(5 / (row["ttft_ms"] / 1e3))
    assert row["decode_tokens_per_s"] > 0 and row["load_s"] > 0 and row["peak_rss_mb"] > 10
    assert row["generations"] == 3  # random prompts: --repeats generations


def test_a_failing_child_is_one_error_with_its_stderr(tmp_path):
    """A child's user error (exit code 2) is the parent's, its one line; any other failure keeps the stderr."""
    with pytest.raises(UserError, match="^unknown artifact type: program.xyz$"):
        run_child(["decode", tmp_path, "program.xyz"], threads=1)
    with pytest.raises(RuntimeError, match=r"(?s)failed:.*error: argument kind: invalid choice"):
        run_child(["nonsense", tmp_path, "program.xyz"], threads=1)


def test_build_unless_current_rebuilds_on_new_inputs_or_changed_files(tmp_path):
    built = []

    def build():
        built.append(1)
        (tmp_path / "a.bin").write_bytes(b"program %d" % len(built))
        return [tmp_path / "a.bin"]

    marker = tmp_path / "marker.json"
    record, fresh = build_unless_current(marker, {"weights": "x"}, build)
    assert fresh and record["files"][0]["bytes"] == 9 and record["inputs"] == {"weights": "x"}
    assert build_unless_current(marker, {"weights": "x"}, build) == (record, False) and len(built) == 1
    assert build_unless_current(marker, {"weights": "y"}, build)[1] and len(built) == 2  # other inputs
    (tmp_path / "a.bin").write_bytes(b"edited!!!!")
    assert build_unless_current(marker, {"weights": "y"}, build)[1] and len(built) == 3  # a changed file
    (tmp_path / "a.bin").unlink()
    assert build_unless_current(marker, {"weights": "y"}, build)[1] and len(built) == 4  # a missing file
