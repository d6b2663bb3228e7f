"""Development build of the prefill kernel alone (until CpuOps binds it in csrc/bindings.cpp).

Compiles ``cp_attention/ops/csrc/varlen_attention.cpp`` plus a one-line binding with
``torch.utils.cpp_extension.load`` (cached under the torch extensions directory).
"""
from __future__ import annotations

import functools
from pathlib import Path

CSRC = Path(__file__).resolve().parents[1] / "cp_attention" / "ops" / "csrc"
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c"]

_BINDING = """
#include <torch/extension.h>
#include "varlen_attention.h"
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("varlen_attention", &varlen_attention_cpu, "causal / varlen prefill attention with LSE");
}
"""


@functools.lru_cache(maxsize=None)
def load_varlen_kernel():
    """The compiled module (``.varlen_attention(q, k, v, cu_q, cu_k, scale, causal, window)``)."""
    from torch.utils.cpp_extension import load_inline
    source = (CSRC / "varlen_attention.cpp").read_text()
    return load_inline(name="cp_attention_varlen_dev", cpp_sources=[source, _BINDING],
                       extra_cflags=FLAGS, extra_include_paths=[str(CSRC)], verbose=False)
