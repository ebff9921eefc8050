"""What the interpreter ran, built by the GPU compiler's front end (Triton source -> TTIR for sm90)
on a machine without a GPU.

Why: the CPU interpreter runs a kernel as Python, so it accepts code the compiler rejects. A
helper returning int8 codes in a discarded constexpr branch and bf16 in the other ran under the
interpreter and failed to compile on the H200 ("Inconsistent return types"), a device call lost.
The front end needs no GPU: it types every statement of the kernel and its callees for the
launch's argument types and constexpr values, which the interpreter's launches give. tests/conftest.py
records every launch of a session and builds each specialization once at its end (~9 s for the
172 of the kernel and method tests).
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import subprocess
import sys
from contextlib import contextmanager
from typing import Iterator

import torch
from triton.runtime.interpreter import InterpretedFunction

_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int8: "i8",
           torch.int16: "i16", torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8", torch.uint16: "u16",
           torch.bool: "i1"}

# the subprocess: no interpreter, so `triton.jit` gives the compiler's JITFunction
_BUILD = """
import importlib, json, sys
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDABackend
from triton.compiler import ASTSource
import triton._C.libtriton as lt
target = GPUTarget("cuda", 90, 32)
backend = CUDABackend(target)
options = backend.parse_options({})
errors = []
for launch in json.load(sys.stdin):
    fn = getattr(importlib.import_module(launch["module"]), launch["name"])
    names = fn.arg_names
    consts = {(names.index(k),): v for k, v in launch["constexprs"].items()}
    src = ASTSource(fn, launch["signature"], constexprs=consts)
    context = lt.ir.context()
    lt.ir.load_dialects(context)
    backend.load_dialects(context)
    try:
        src.make_ir(target, options, backend.get_codegen_implementation(options), backend.get_module_map(), context)
    except Exception as e:  # the innermost cause names the problem; the outer ones the call site
        while e.__cause__ is not None:
            e = e.__cause__
        errors.append(f"{launch['name']} {launch['constexprs']}: {type(e).__name__}: {e}")
print(json.dumps(errors))
"""


def launch_record(fn, args: tuple, kwargs: dict) -> dict | None:
    """(module, name, signature, constexprs) of one launch, as the compiler's ASTSource takes them;
    None for an argument type this does not map (the launch is then not checked)."""
    params = _parameters(fn)
    bound = dict(zip(params, args)) | {k: v for k, v in kwargs.items() if k in params}
    signature, constexprs = {}, {}
    for name, p in params.items():
        value = bound.get(name, p.default)
        if "constexpr" in str(p.annotation) or value is None or isinstance(value, str):
            signature[name], constexprs[name] = "constexpr", value
        elif isinstance(value, torch.Tensor) and value.dtype in _DTYPES:
            signature[name] = "*" + _DTYPES[value.dtype]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            return None
    return {"module": fn.__module__, "name": fn.__name__, "signature": signature, "constexprs": constexprs}


@functools.cache
def _parameters(fn) -> dict[str, inspect.Parameter]:
    return dict(inspect.signature(fn).parameters)


@contextmanager
def recorded_launches() -> Iterator[list[dict]]:
    """Every interpreted launch inside the block, recorded once a specialization. Recording never
    fails a launch: one it cannot map is left out."""
    launches: list[dict] = []
    seen: set[str] = set()
    run = InterpretedFunction.run

    def recording(self, *args, grid, warmup, **kwargs):
        try:
            record = launch_record(self.fn, args, kwargs)
            key = json.dumps(record, sort_keys=True)  # the subprocess takes it as JSON
        except Exception:  # noqa: BLE001 - a launch this cannot describe runs unchecked
            record = None
        if record is not None and key not in seen:
            seen.add(key)
            launches.append(record)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)
    InterpretedFunction.run = recording
    try:
        yield launches
    finally:
        InterpretedFunction.run = run


def frontend_errors(launches: list[dict]) -> list[str]:
    """The compiler front end's error for each launch it rejects ([] when it builds them all)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # the kernels' modules import as here
    done = subprocess.run([sys.executable, "-c", _BUILD], input=json.dumps(launches), capture_output=True,
                          text=True, env=env, timeout=600)
    if done.returncode:
        raise RuntimeError(f"the front-end build failed to run: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
