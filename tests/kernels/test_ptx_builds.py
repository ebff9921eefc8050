"""The score kernels' inline PTX (dp4a, prmt, shared-memory atomics) assembles for the H100, and
kernels no GPU has run yet (follow's) lower to sm_90 at all.

CI has no GPU, and the CPU interpreter never emits PTX, so without this a broken asm string
would only show on the device. Each kernel is compiled ahead of time for sm_90 (Triton's
bundled ptxas) in a subprocess without TRITON_INTERPRET (the kernel tests run under it), and
its SASS must hold the instructions the PTX asks for."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

_COMPILE = """
import json, os, subprocess, sys, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import importlib
spec = json.loads(sys.argv[1])
fn = getattr(importlib.import_module(spec["module"]), spec["kernel"])
const = dict(spec["const"])
const.update({p.name: p.default for p in fn.params if p.is_constexpr and p.has_default and p.name not in const})
sig = {p.name: "constexpr" if p.is_constexpr else spec["types"].get(p.name, spec["default"]) for p in fn.params}
names = list(sig)
src = ASTSource(fn, sig, {(names.index(k),): v for k, v in const.items()})
kern = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": spec["num_warps"]})
path = os.path.join(os.environ["OUT_DIR"], "kernel.cubin")
open(path, "wb").write(kern.asm["cubin"])
tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
print(subprocess.run([tool, "-c", path], capture_output=True, text=True, check=True).stdout)
"""

_LENGTHS = {n: "*i32" for n in ("nctx_ptr", "start_ptr", "cnt_ptr", "lo_ptr", "hi_ptr", "k_ptr", "ws_ptr", "ids_ptr")}
_COMMON = {**_LENGTHS, "w_ptr": "*fp32", "scale_ptr": "*fp32", "ns_ptr": "*fp32", "key_ptr": "*u16",
           "sd_b": "i64", "sd_h": "i64"}

CASES = {
    # int8 tables: prmt byte transpose + dp4a, pass 0 by shared-memory atomics
    "dense_dot8": ({"module": "ctxcache.kernels.dense_dot8", "kernel": "_dense_dot8_kernel",
                    "types": {**_COMMON, "ds_ptr": "*i32"}, "default": "i32", "num_warps": 4,
                    "const": {"HKV": 8, "G": 1, "M": 8, "GM_PAD": 8, "R_CHUNK": 1, "BLOCK": 1024, "HIST0": True,
                              "ASM": True, "SMEM": True, "USE_PDL": True, "ROW_EVICT": "evict_first"}},
                   ("IDP.4A", "PRMT", "ATOMS.POPC.INC")),
    # fp16 tables: pass 0 by shared-memory atomics
    "dense_scores": ({"module": "ctxcache.kernels.dense_select", "kernel": "_dense_score_kernel",
                      "types": {**_COMMON, "ds_ptr": "*fp16", "acc_ptr": "*u16"}, "default": "i32", "num_warps": 4,
                      "const": {"HKV": 8, "G": 1, "M": 8, "GM_PAD": 8, "R_CHUNK": 8, "BLOCK": 1024, "SCALED": False,
                                "KEY16": True, "HIST0": True, "ALIGN16": True, "USE_PDL": True,
                                "ROW_EVICT": "evict_first", "SMEM": True}},
                     ("ATOMS.POPC.INC",)),
    # CSAttention's follow: successors to the top 16-bit key, the histogram moved by global atomics
    "follow_promote": ({"module": "ctxcache.kernels.follow", "kernel": "_promote_kernel",
                        "types": {**_COMMON, "prev_ptr": "*i32"}, "default": "i32", "num_warps": 4,
                        "const": {"FP": 128}},
                       ("STG.E.U16", "REDG.E.ADD")),
    # reselect: a carried row's candidates (the selection, new successors, the new key, padding)
    "carry": ({"module": "ctxcache.kernels.carry", "kernel": "_carry_kernel",
               "types": {**{n: "*i32" for n in ("prev_ptr", "fprev_ptr", "carried_ptr", "lo_ptr", "hi_ptr", "kp_ptr",
                                                "kc_ptr", "cand_ptr", "z_ptr")}, "mark_ptr": "*i8"},
               "default": "i32", "num_warps": 4, "const": {"FP": 128, "BLOCK": 256, "ZERO": True, "USE_PDL": True}},
              ("STG.E",)),
    "follow_out": ({"module": "ctxcache.kernels.follow", "kernel": "_follow_out_kernel",
                    "types": {n: "*i32" for n in ("cand_ptr", "slot_ptr", "kf_ptr", "out_ptr")}, "default": "i32",
                    "num_warps": 4, "const": {"FP": 128}},
                   ("STG.E",)),
    # the packed prefill's spans (no GPU has run it yet): its two products on the tensor cores
    "span_attention": ({"module": "ctxcache.kernels.span_attention", "kernel": "_span_attention_kernel",
                        "types": {**{n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "o_ptr")}, "lse_ptr": "*fp32",
                                  "scale_log2": "fp32"}, "default": "i32", "num_warps": 8,
                        "const": {"D": 128, "BLOCK_M": 128, "BLOCK_N": 64, "IEEE": False}},
                       ("MMA",)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_inline_ptx_assembles_for_sm90(tmp_path, name):
    import triton

    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    if not (bin_dir / "ptxas").exists() or not (bin_dir / "nvdisasm").exists():
        pytest.skip("this Triton wheel ships no ptxas / nvdisasm")
    spec, opcodes = CASES[name]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(OUT_DIR=str(tmp_path), TRITON_CACHE_DIR=str(tmp_path / "cache"))
    res = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps(spec)], capture_output=True, text=True,
                         env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    for op in opcodes:
        assert op in res.stdout, f"{op} missing from {name}'s sm_90 SASS"
