"""pyflashattn's own dtype table.

Why our own: numpy has no fp8/fp4, cuda.core's StridedMemoryView rejects DLPack fp8 codes, and
frameworks spell dtypes differently (``torch.bfloat16``, ``ml_dtypes.bfloat16``, ``'bf16'``). One
table keyed by the DLPack type code (dlpack.h v1.3, as shipped in cuda-core 1.2.2's
``_include/dlpack.h``) serves the capsule reader, argument normalisation and output allocation.

Canonical names are the numpy / ml_dtypes / torch spellings (``'float8_e4m3fn'``), so
``np.dtype(x).name`` and ``str(torch_dtype)`` (minus ``'torch.'``) map straight onto them.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DType", "from_dlpack_code", "normalize", "ALL"]

# DLDataTypeCode (dlpack.h). Codes 7..17 arrived in DLPack 1.1.
kDLInt = 0
kDLUInt = 1
kDLFloat = 2
kDLOpaqueHandle = 3  # not a numeric type: rejected
kDLBfloat = 4
kDLComplex = 5
kDLBool = 6
kDLFloat8_e3m4 = 7
kDLFloat8_e4m3 = 8
kDLFloat8_e4m3b11fnuz = 9
kDLFloat8_e4m3fn = 10
kDLFloat8_e4m3fnuz = 11
kDLFloat8_e5m2 = 12
kDLFloat8_e5m2fnuz = 13
kDLFloat8_e8m0fnu = 14
kDLFloat6_e2m3fn = 15
kDLFloat6_e3m2fn = 16
kDLFloat4_e2m1fn = 17


@dataclass(frozen=True)
class DType:
    """One element type.

    ``bits`` is the storage size of one *element* as the tensor's shape counts elements, so
    ``nbytes`` is right for every entry. ``lanes`` is 1 except for torch's packed
    ``float4_e2m1fn_x2`` (one byte = two fp4 values), which DLPack describes as bits=4, lanes=2.
    """

    name: str
    code: int
    bits: int
    short: str
    lanes: int = 1

    def nbytes(self, numel: int) -> int:
        # Round up so a sub-byte tensor with an odd element count still gets its last byte.
        return (numel * self.bits + 7) // 8

    @property
    def dlpack(self) -> tuple[int, int, int]:
        """(code, bits, lanes) as a DLDataType spells it."""
        return (self.code, self.bits // self.lanes, self.lanes)

    def __repr__(self) -> str:
        return f"pyflashattn.{self.name}"


FLOAT16 = DType("float16", kDLFloat, 16, "f16")
BFLOAT16 = DType("bfloat16", kDLBfloat, 16, "bf16")
FLOAT32 = DType("float32", kDLFloat, 32, "f32")
FLOAT64 = DType("float64", kDLFloat, 64, "f64")
FLOAT8_E4M3 = DType("float8_e4m3fn", kDLFloat8_e4m3fn, 8, "e4m3")  # OCP/NVIDIA e4m3 (no inf)
FLOAT8_E4M3FN = FLOAT8_E4M3
FLOAT8_E5M2 = DType("float8_e5m2", kDLFloat8_e5m2, 8, "e5m2")
FLOAT8_E8M0 = DType("float8_e8m0fnu", kDLFloat8_e8m0fnu, 8, "e8m0")  # MX block scales
FLOAT4_E2M1 = DType("float4_e2m1fn", kDLFloat4_e2m1fn, 4, "e2m1")  # packed, 2 per byte
FLOAT4_E2M1_X2 = DType("float4_e2m1fn_x2", kDLFloat4_e2m1fn, 8, "e2m1x2", lanes=2)  # torch's
# The rest of DLPack's float codes: readable from capsules, no kernels use them.
FLOAT8_E3M4 = DType("float8_e3m4", kDLFloat8_e3m4, 8, "e3m4")
FLOAT8_E4M3_IEEE = DType("float8_e4m3", kDLFloat8_e4m3, 8, "e4m3ieee")  # IEEE-style, has inf
FLOAT8_E4M3B11FNUZ = DType("float8_e4m3b11fnuz", kDLFloat8_e4m3b11fnuz, 8, "e4m3b11fnuz")
FLOAT8_E4M3FNUZ = DType("float8_e4m3fnuz", kDLFloat8_e4m3fnuz, 8, "e4m3fnuz")
FLOAT8_E5M2FNUZ = DType("float8_e5m2fnuz", kDLFloat8_e5m2fnuz, 8, "e5m2fnuz")
FLOAT6_E2M3 = DType("float6_e2m3fn", kDLFloat6_e2m3fn, 6, "e2m3")
FLOAT6_E3M2 = DType("float6_e3m2fn", kDLFloat6_e3m2fn, 6, "e3m2")
INT8 = DType("int8", kDLInt, 8, "i8")
INT16 = DType("int16", kDLInt, 16, "i16")
INT32 = DType("int32", kDLInt, 32, "i32")
INT64 = DType("int64", kDLInt, 64, "i64")
UINT8 = DType("uint8", kDLUInt, 8, "u8")
UINT16 = DType("uint16", kDLUInt, 16, "u16")
UINT32 = DType("uint32", kDLUInt, 32, "u32")
UINT64 = DType("uint64", kDLUInt, 64, "u64")
BOOL = DType("bool", kDLBool, 8, "b8")
COMPLEX64 = DType("complex64", kDLComplex, 64, "c64")
COMPLEX128 = DType("complex128", kDLComplex, 128, "c128")

ALL: tuple[DType, ...] = tuple(v for v in dict(globals()).values() if isinstance(v, DType))
ALL = tuple(dict.fromkeys(ALL))  # FLOAT8_E4M3FN is an alias: keep one entry

_BY_DLPACK: dict[tuple[int, int, int], DType] = {d.dlpack: d for d in ALL}
# Producers that predate kDLBool (numpy < 1.25, old torch) export bool as 8-bit uint; that is
# indistinguishable from uint8, which is what it then is for us.

_BY_NAME: dict[str, DType] = {}
for _d in ALL:
    _BY_NAME[_d.name] = _d
    _BY_NAME[_d.short] = _d
# String aliases follow torch's attribute names (FlashInfer resolves dtype strings via
# getattr(torch, s)), so 'float' is float32; Python/numpy *type objects* follow numpy (float ->
# float64). Plus the fp8/fp4 spellings used in serving configs.
for _alias, _d in {
    "half": FLOAT16, "fp16": FLOAT16,
    "float": FLOAT32, "fp32": FLOAT32,
    "double": FLOAT64, "fp64": FLOAT64,
    "fp8_e4m3": FLOAT8_E4M3, "fp8_e4m3fn": FLOAT8_E4M3, "e4m3fn": FLOAT8_E4M3,
    "fp8_e5m2": FLOAT8_E5M2,
    "fp8_e8m0": FLOAT8_E8M0, "e8m0fnu": FLOAT8_E8M0,
    "fp4_e2m1": FLOAT4_E2M1, "e2m1fn": FLOAT4_E2M1,
    "short": INT16, "int": INT32, "long": INT64,
    "cfloat": COMPLEX64, "cdouble": COMPLEX128,
}.items():
    _BY_NAME[_alias] = _d
del _alias, _d


def from_dlpack_code(code: int, bits: int, lanes: int) -> DType:
    """Map a DLDataType to a DType; TypeError for anything pyflashattn cannot represent."""
    d = _BY_DLPACK.get((code, bits, lanes))
    if d is not None:
        return d
    if lanes != 1:
        raise TypeError(f"vector DLPack dtypes are not supported (code={code}, bits={bits}, lanes={lanes})")
    raise TypeError(f"unsupported DLPack dtype (code={code}, bits={bits}, lanes={lanes})")


_CACHE: dict[object, DType] = {}


def normalize(x) -> DType:
    """Accept a DType, a string ('bf16', 'torch.bfloat16', 'e4m3', ...), a numpy/ml_dtypes/JAX/CuPy
    dtype or scalar type, or a torch dtype; return the DType. TypeError naming the value otherwise."""
    if isinstance(x, DType):
        return x
    try:
        return _CACHE[x]
    except (KeyError, TypeError):  # TypeError: unhashable
        pass
    d = _normalize_uncached(x)
    if d is None:
        raise TypeError(f"unsupported dtype {x!r}")
    try:
        _CACHE[x] = d
    except TypeError:
        pass
    return d


def _normalize_uncached(x) -> DType | None:
    if isinstance(x, str):
        return _from_str(x)
    if x is None:  # np.dtype(None) is float64: never guess
        return None
    # torch.dtype has no numpy mapping; str(torch.bfloat16) == 'torch.bfloat16'. Checked by module
    # name so torch is never imported.
    if type(x).__module__.partition(".")[0] == "torch":
        return _from_str(str(x))
    import numpy as np

    try:
        # numpy dtypes, numpy scalar types, ml_dtypes types (name 'bfloat16', 'float8_e4m3fn'),
        # jnp.bfloat16 and CuPy dtypes (which are numpy dtypes) all land here.
        return _BY_NAME.get(np.dtype(x).name)
    except (TypeError, ValueError):
        return _from_str(str(x))


def _from_str(s: str) -> DType | None:
    key = s.strip().lower()
    d = _BY_NAME.get(key)
    if d is None and "." in key:  # 'torch.bfloat16', 'jnp.float16', 'ml_dtypes.bfloat16'
        d = _BY_NAME.get(key.rpartition(".")[2])
    if d is None and key[:1] in "<>=|" and len(key) > 1:  # numpy typestr such as '<f2'
        import numpy as np

        try:
            d = _BY_NAME.get(np.dtype(key).name)
        except TypeError:
            d = None
    return d
