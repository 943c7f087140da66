"""Run a kernel's Metal source body on the CPU, thread by thread.

`EmulatedKernel(spec, build_dir)` stands in for the object `mx.fast.metal_kernel`
returns and takes the same call keywords (inputs, template, grid, threadgroup,
output_shapes, output_dtypes, init_value). Per call it writes a C++ translation
unit: metal_shim.h, the spec's header, the body wrapped in the signature MLX would
generate (same parameter names, types and template parameters), and a loop over
every thread of the grid; compiles it with g++ (cached by content in build_dir),
loads it with ctypes and runs it on numpy copies of the inputs. Outputs start as
NaN (or init_value), so an element no thread writes shows up in any comparison.
"""

from __future__ import annotations

import ctypes
import hashlib
import re
import shutil
import subprocess
from pathlib import Path

import mlx.core as mx
import numpy as np

SHIM = Path(__file__).with_name("metal_shim.h")

# Metal type names MLX uses in generated signatures, and the numpy storage for each.
_TYPES = {
    mx.float32: ("float", np.float32),
    mx.float16: ("float16_t", np.float16),
    mx.bfloat16: ("bfloat16_t", np.uint16),
    mx.int32: ("int32_t", np.int32),
    mx.uint32: ("uint32_t", np.uint32),
    mx.int64: ("int64_t", np.int64),
    mx.uint8: ("uint8_t", np.uint8),
    mx.bool_: ("bool", np.bool_),
}
_GRID_ATTRIBUTES = (
    "thread_position_in_grid",
    "threads_per_grid",
    "thread_position_in_threadgroup",
    "threadgroup_position_in_grid",
    "threads_per_threadgroup",
)
_LOADED: dict[Path, ctypes.CDLL] = {}


def compiler_available() -> bool:
    return shutil.which("g++") is not None


def _to_numpy(a: mx.array) -> np.ndarray:
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.ascontiguousarray(np.array(a))  # ensure_row_contiguous, as MLX does by default


def _from_numpy(a: np.ndarray, dtype: mx.Dtype) -> mx.array:
    out = mx.array(a)
    return out.view(mx.bfloat16) if dtype == mx.bfloat16 else out


def _blank(shape: tuple[int, ...], dtype: mx.Dtype, init_value: float | None) -> np.ndarray:
    if init_value is not None:
        return _to_numpy(mx.full(shape, init_value, dtype=dtype))
    if dtype in (mx.float32, mx.float16, mx.bfloat16):
        return _to_numpy(mx.full(shape, float("nan"), dtype=dtype))
    return np.full(shape, np.iinfo(_TYPES[dtype][1]).max, dtype=_TYPES[dtype][1])


def _template_value(value) -> tuple[str, str]:
    if isinstance(value, mx.Dtype):
        return "typename", _TYPES[value][0]
    if isinstance(value, bool):
        return "bool", "true" if value else "false"
    if isinstance(value, int):
        return "int", str(value)
    raise TypeError(f"unsupported template value {value!r}")


class EmulatedKernel:
    def __init__(self, spec, build_dir: Path):
        self.spec = spec
        self.build_dir = Path(build_dir)

    def translation_unit(self, inputs: list[mx.array], output_dtypes: list[mx.Dtype], template) -> str:
        spec, source = self.spec, self.spec.source
        params, args = [], []
        slot = 0
        for name, a in zip(spec.input_names, inputs, strict=True):
            ctype = _TYPES[a.dtype][0]
            if a.ndim == 0:
                params.append(f"const constant {ctype}& {name}")
                args.append(f"*(const {ctype}*)bufs[{slot}]")
            else:
                params.append(f"const device {ctype}* {name}")
                args.append(f"(const {ctype}*)bufs[{slot}]")
            slot += 1
            if a.ndim > 0:
                for suffix, ctype_meta in (("shape", "int"), ("strides", "int64_t"), ("ndim", "int")):
                    if re.search(rf"\b{name}_{suffix}\b", source):
                        star = "&" if suffix == "ndim" else "*"
                        params.append(f"const constant {ctype_meta}{star} {name}_{suffix}")
                        deref = "*" if suffix == "ndim" else ""
                        args.append(f"{deref}(const {ctype_meta}*)bufs[{slot}]")
                        slot += 1
        for name, dtype in zip(spec.output_names, output_dtypes, strict=True):
            ctype = _TYPES[dtype][0]
            params.append(f"device {ctype}* {name}")
            args.append(f"({ctype}*)bufs[{slot}]")
            slot += 1
        params += [f"uint3 {attr}" for attr in _GRID_ATTRIBUTES]
        args += ["tpig", "tpg", "tpitg", "tgpig", "tptg"]
        tparams = [_template_value(v) for _, v in template]
        names = [n for n, _ in template]
        tdecl = "template <" + ", ".join(f"{kind} {n}" for n, (kind, _) in zip(names, tparams, strict=True)) + ">\n"
        targs = "<" + ", ".join(v for _, v in tparams) + ">" if template else ""
        return "\n".join([
            f'#include "{SHIM.name}"',
            spec.header,
            (tdecl if template else "") + f"void {spec.name}(" + ", ".join(params) + ") {",
            spec.source,
            "}",
            'extern "C" void dflash_emulate(void** bufs, const uint* g, const uint* t) {',
            "  const uint3 tpg{g[0], g[1], g[2]};",
            "  const uint3 tptg{t[0], t[1], t[2]};",
            "  for (uint z = 0; z < g[2]; ++z) for (uint y = 0; y < g[1]; ++y) for (uint x = 0; x < g[0]; ++x) {",
            "    const uint3 tpig{x, y, z};",
            "    const uint3 tpitg{x % t[0], y % t[1], z % t[2]};",
            "    const uint3 tgpig{x / t[0], y / t[1], z / t[2]};",
            f"    {spec.name}{targs}(" + ", ".join(args) + ");",
            "  }",
            "}",
            "",
        ])

    def _library(self, code: str) -> ctypes.CDLL:
        digest = hashlib.sha256((code + SHIM.read_text()).encode()).hexdigest()[:20]
        lib_path = self.build_dir / f"{self.spec.name}_{digest}.so"
        if lib_path not in _LOADED:
            if not lib_path.exists():
                src = lib_path.with_suffix(".cpp")
                src.write_text(code)
                cmd = ["g++", "-std=c++17", "-O1", "-ffp-contract=off", "-shared", "-fPIC",
                       f"-I{SHIM.parent}", "-o", str(lib_path), str(src)]
                result = subprocess.run(cmd, capture_output=True, text=True)
                if result.returncode != 0:
                    raise RuntimeError(f"kernel {self.spec.name} failed to compile:\n{result.stderr}")
            lib = ctypes.CDLL(str(lib_path))
            lib.dflash_emulate.argtypes = [ctypes.POINTER(ctypes.c_void_p)] + [ctypes.POINTER(ctypes.c_uint)] * 2
            lib.dflash_emulate.restype = None
            _LOADED[lib_path] = lib
        return _LOADED[lib_path]

    def __call__(
        self,
        *,
        inputs: list[mx.array],
        output_shapes: list[tuple[int, ...]],
        output_dtypes: list[mx.Dtype],
        grid: tuple[int, int, int],
        threadgroup: tuple[int, int, int],
        template=(),
        init_value: float | None = None,
        verbose: bool = False,
        stream=None,
    ) -> list[mx.array]:
        lib = self._library(self.translation_unit(inputs, output_dtypes, template))
        keep = []  # every buffer, alive until the call returns
        for name, a in zip(self.spec.input_names, inputs, strict=True):
            keep.append(_to_numpy(a))
            if a.ndim > 0:
                if re.search(rf"\b{name}_shape\b", self.spec.source):
                    keep.append(np.array(a.shape, dtype=np.int32))
                if re.search(rf"\b{name}_strides\b", self.spec.source):
                    keep.append(np.array([s // a.itemsize for s in _to_numpy(a).strides], dtype=np.int64))
                if re.search(rf"\b{name}_ndim\b", self.spec.source):
                    keep.append(np.array([a.ndim], dtype=np.int32))
        outputs = [_blank(tuple(s), d, init_value) for s, d in zip(output_shapes, output_dtypes, strict=True)]
        keep += outputs
        bufs = (ctypes.c_void_p * len(keep))(*[b.ctypes.data for b in keep])
        # As on Metal, a threadgroup dimension never exceeds the grid's.
        group = [max(1, min(t, g)) for t, g in zip(threadgroup, grid, strict=True)]
        g = (ctypes.c_uint * 3)(*grid)
        t = (ctypes.c_uint * 3)(*group)
        lib.dflash_emulate(bufs, g, t)
        return [_from_numpy(o, d) for o, d in zip(outputs, output_dtypes, strict=True)]
