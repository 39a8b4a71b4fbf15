"""The C side of a kernel library as ctypes sees it: the exported functions' signatures and the structures they
take (common.h's `part_t`, layers.h's `sk_product_t`, `sk_layer_t`, `sk_seq_t` and `sk_draft_t`)."""

from __future__ import annotations

import ctypes

_P, _I, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
# The C functions every kernel library exports, as ctypes calls them: name -> (return type, argument types). One
# table, which tests/test_kernels.py checks against the prototypes in the headers (common.h, quant.h, layers.h,
# dot4.h), so that a changed C signature cannot go unnoticed on the Python side.
SIGNATURES: dict[str, tuple[type | None, list[type]]] = {
    "sk_init": (ctypes.c_int, []),
    "sk_linear": (None, [_P, _P, _P, _P, _I, _I, _I, _I, _I, _P, ctypes.c_float, _P, _P]),
    "sk_qlinear": (None, [_I, _P, ctypes.c_long, _P, _P, _I, _P, _I, _I, _I, _I, _I, _P, ctypes.c_float, _P, _P]),
    "sk_attention": (None, [_P, _I, _I, _I, _I, _I, _I, _I, ctypes.c_float, _I]),
    "sk_rms_norm": (None, [_P, _P, _P, _I, _I, ctypes.c_float, _P]),
    "sk_q_pack": (None, [_I, _P, ctypes.c_long, _I, _P, _I]),
    "sk_q_unpack": (None, [_I, _P, ctypes.c_long, _P, _I, _P]),
    "sk_layers": (
        None,
        [_P, _I, _P, _P, _I, _I, _I, _I, _I, _I, _P, _P, _P, _P, ctypes.c_float, ctypes.c_float, _I],
    ),
    "sk_draft_chain": (
        ctypes.c_int,
        [_P, _P, _P, _I, _P, _P, ctypes.c_int64, ctypes.c_int64, _P, _P, _I, _F, _F, _I, _P, _P, _P],
    ),
    "sk_dot_kind": (ctypes.c_char_p, []),
}
# Exported only by libraries whose integer products take dot4.h's dot products (`KernelSpec.dot`).
DOT_ONLY = frozenset({"sk_dot_kind"})


def bind(lib: ctypes.CDLL, dot: bool) -> None:
    """Give `lib`'s functions their `SIGNATURES` (`dot`: it exports the `DOT_ONLY` ones too)."""
    for function, (restype, argtypes) in SIGNATURES.items():
        if function in DOT_ONLY and not dot:
            continue
        getattr(lib, function).restype = restype
        getattr(lib, function).argtypes = argtypes


class Part(ctypes.Structure):
    """One sequence of an attention call (common.h's part_t)."""

    _fields_ = [(name, ctypes.c_void_p) for name in ("q", "k", "v", "kc", "vc", "out")] + [
        (name, ctypes.c_int64) for name in ("cap", "t", "start")
    ]
    _fields_ += [("parent", ctypes.c_void_p)]


class Product(ctypes.Structure):
    """One product of a layer stack (layers.h's sk_product_t): bf16 laid out, or up to 4 quantized segments."""

    _fields_ = [("w", ctypes.c_void_p), ("bias", ctypes.c_void_p), ("n", ctypes.c_int64), ("nseg", ctypes.c_int64)]
    _fields_ += [(name, ctypes.c_int64 * 4) for name in ("type", "rows", "row_bytes")]
    _fields_ += [("data", ctypes.c_void_p * 4)]


class Layer(ctypes.Structure):
    """One decoder layer of a layer stack (layers.h's sk_layer_t)."""

    _fields_ = [(name, Product) for name in ("qkv", "o", "gate_up", "down")]
    _fields_ += [(name, ctypes.c_void_p) for name in ("attn_norm", "ffn_norm", "q_norm", "k_norm")]
    _fields_ += [(name, ctypes.c_void_p) for name in ("post_attn_norm", "post_ffn_norm")]
    _fields_ += [(name, ctypes.c_int64) for name in ("gelu", "window", "local")]


class Seq(ctypes.Structure):
    """One sequence of a layer stack call (layers.h's sk_seq_t)."""

    _fields_ = [("kc", ctypes.c_void_p), ("vc", ctypes.c_void_p)]
    _fields_ += [(name, ctypes.c_int64) for name in ("layer_stride", "cap", "t", "start")]
    _fields_ += [("parent", ctypes.c_void_p)]


class Draft(ctypes.Structure):
    """A feature draft for sk_draft_chain (layers.h's sk_draft_t)."""

    _fields_ = [("fc", Product), ("head", Product), ("layer", Layer)]
    _fields_ += [(name, ctypes.c_void_p) for name in ("norm", "embed")]
    _fields_ += [(name, ctypes.c_int64) for name in ("dim", "heads", "kv_heads", "head_dim", "inter", "vocab")]
    _fields_ += [(name, ctypes.c_float) for name in ("eps", "scale")]
