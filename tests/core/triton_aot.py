"""(Helper, not a test.) Every Triton kernel of the providers compiled ahead of time for sm_90,
no GPU needed (``python -m tests.core.triton_checks aot``, run by
``tests/core/test_triton_kernels.py`` without the interpreter): :func:`aot_all` over each
provider module's ``AOT`` variants, through ``triton.compile`` where Triton's ptxas runs, else
the compiler's stages up to PTX (:func:`compile_sm90`).
"""
import re

__all__ = ["PTX_VERSION", "ptxas_runs", "compile_sm90", "aot_all"]

PTX_VERSION = 84  # PTX ISA 8.4 (CUDA 12.4, which knows sm_90) when Triton's ptxas cannot run


def ptxas_runs() -> bool:
    """True if the ptxas that Triton bundles (or ``TRITON_PTXAS_BLACKWELL_PATH`` names) runs."""
    from triton.backends.nvidia.compiler import get_ptxas
    try:
        return get_ptxas(90).version is not None
    except Exception:  # noqa: BLE001 - no binary, not executable, wrong machine
        return False


def compile_sm90(fn, signature, constexprs, options, cubin=True):
    """(ptx text, cubin bytes or None) of a Triton kernel for sm_90 (``GPUTarget("cuda", 90,
    32)``), without a GPU. ``cubin``: through ``triton.compile`` (which runs ptxas); otherwise
    the compiler's stages up to PTX only (ttir, ttgir, llir, ptx; PTX ISA :data:`PTX_VERSION`),
    for a machine where ptxas cannot run."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton._C.libtriton import ir
    src = ASTSource(fn, signature, constexprs=constexprs)
    target = GPUTarget("cuda", 90, 32)
    if cubin:
        kernel = triton.compile(src, target=target, options=dict(options))
        return kernel.asm["ptx"], kernel.asm["cubin"]
    backend = make_backend(target)
    opts = backend.parse_options(dict(options, ptx_version=PTX_VERSION))
    stages = {}
    backend.add_stages(stages, opts, src.language)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    module = src.make_ir(target, opts, backend.get_codegen_implementation(opts), backend.get_module_map(), context)
    metadata = {"hash": "aot", "target": target, **opts.__dict__}
    for ext, stage in stages.items():
        module = stage(module, metadata)
        if ext == "ptx":
            return module, None
    raise RuntimeError("no ptx stage in Triton's CUDA backend")


def aot_all(ptx_only=False, limit=None):
    """Every Triton kernel of the two providers compiled for sm_90 (each module's ``AOT``
    variants): {name: {"ptx": text's facts, "cubin": bytes, "error": ...}}, plus
    ``"uncovered"``: jit functions of the providers that no ``AOT`` entry compiles (neither a
    kernel there nor named in one); ``"ptxas_runs"``. ``ptx_only``: the stages up to
    PTX alone (:func:`compile_sm90`); ``limit``: the first ``limit`` entries of each module."""
    from triton.runtime.jit import JITFunction
    from torch_backend.kernels import (triton_powersgd, triton_signsgd, triton_thc, triton_thc_fused, triton_thc_words,
                                       triton_topkc)
    cubin = ptxas_runs() and not ptx_only
    results, uncovered = {"ptxas_runs": ptxas_runs()}, []
    for module in (triton_thc, triton_thc_words, triton_thc_fused, triton_topkc, triton_powersgd, triton_signsgd):
        jitted = {name: value for name, value in vars(module).items() if isinstance(value, JITFunction)}
        covered = {fn for _, fn, _, _ in module.AOT}
        grew = True
        while grew:  # helpers named in a covered kernel (or helper) are compiled in it
            sources = "\n".join(fn.src for fn in covered)
            called = {fn for name, fn in jitted.items() if re.search(rf"\b{name}\b", sources)}
            grew = not called <= covered
            covered |= called
        uncovered += [f"{module.__name__}.{name}" for name, fn in jitted.items() if fn not in covered]
        entries = module.AOT[:limit] if limit else module.AOT
        for name, fn, signature, constexprs in entries:
            key = f"{module.__name__.rsplit('.', 1)[1]}.{name}"
            try:
                ptx, binary = compile_sm90(fn, signature, constexprs, module._OPTIONS, cubin)
            except Exception as exc:  # noqa: BLE001 - reported, the test fails on it
                results[key] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
                continue
            results[key] = {"target": ".target sm_90" in ptx, "entry": f".entry {fn.__name__}" in ptx,
                            "ptx": len(ptx), "cubin": len(binary) if binary is not None else None,
                            "tf32": "tf32" in ptx, "approx": ".approx" in ptx, "fma": "fma." in ptx}
    results["uncovered"] = uncovered
    return results
