"""A plan's fit is the TPU compiler's verdict; figures it did not give are unknown, never 0."""

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import pytest

import spmd
from spmd._src import plan_compile
from spmd._src.explain import Explanation

pytestmark = pytest.mark.cpu_mesh

GIB = 1 << 30


def _explanation(**memory) -> Explanation:
    fields = dict(
        strategy="s",
        state_bytes=6 * GIB,
        state_host_bytes=0,
        input_bytes=0,
        argument_bytes=6 * GIB,
        output_bytes=6 * GIB,
        alias_bytes=6 * GIB,
        temp_bytes=11 * GIB,
        flops=1e12,
        chip="v5e",
        hbm_capacity=int(15.75 * GIB),
        code_bytes=GIB // 4,
    )
    return Explanation(**(fields | memory))


def test_a_compiled_program_fits_though_its_summed_figure_exceeds_hbm():
    e = _explanation()  # 6 + 11 + 0.25 = 17.25 GiB summed, over 15.75 GiB: the compiler said yes
    assert e.peak_and_code_bytes == int(17.25 * GIB)
    assert e.fits is True and e.hbm_headroom == 0  # at least 0 left: the sum is a bound
    text = str(e)
    assert re.search(r"peak \+ code \(upper bound\) +17.25 GiB \(fits: the compiler accepted", text)
    assert "the bound is 1.50 GiB over HBM" in text and "DOES NOT FIT" not in text


def test_a_refused_program_shows_the_compilers_figure_and_unknowns_as_dashes():
    unknown = dict.fromkeys(["argument_bytes", "output_bytes", "alias_bytes", "temp_bytes"])
    e = _explanation(**unknown, flops=None, code_bytes=None, hbm_required=int(30.8 * GIB))
    assert e.fits is False and e.peak_bytes is None and e.peak_and_code_bytes is None
    assert e.hbm_headroom == int(15.75 * GIB) - int(30.8 * GIB)
    rows = dict(line.strip().split("  ", 1) for line in str(e).splitlines()[1:])
    rows = {k.strip(): v.strip() for k, v in rows.items()}
    assert rows["peak (upper bound)"] == "-" and rows["FLOPs (XLA's estimate)"] == "-"
    assert rows["temporaries"] == "-" and rows["arguments"] == "-" and rows["code"] == "-"
    assert rows["collectives in the program"] == "-"
    assert rows["the compiler needs"].startswith("30.80 GiB (DOES NOT FIT: the compiler refused")


libtpu = pytest.importorskip("libtpu", reason="the TPU compiler (the tpu-compile extra)")


def _create(key):
    return {"w": jax.random.normal(key, (256, 1024))}


def _step(state, x):
    g = jax.grad(lambda p: ((x @ p["w"]) ** 2).mean())(state)
    return jax.tree.map(lambda a, b: a - 0.1 * b, state, g), {}


X = jax.ShapeDtypeStruct((64, 256), jnp.float32)


def test_a_layout_the_compiler_accepts_is_ranked_whatever_its_summed_figure(monkeypatch):
    # The compiler's real memory analysis, its temporaries raised 20 GiB over: the sum of
    # arguments and temporaries then exceeds a v5e's HBM, yet the program compiled.
    real = plan_compile.compile_lowered

    def inflated(lowered):
        out = real(lowered)
        return dataclasses.replace(out, temp_bytes=out.temp_bytes + 20 * GIB)

    monkeypatch.setattr(plan_compile, "compile_lowered", inflated)
    best, plan = spmd.auto_strategy(_create, _step, X, "v5e:2x2", only="FSDP over 4")
    fsdp = plan.best
    assert fsdp.name == "FSDP over 4" and fsdp.dropped is None and best is fsdp.strategy
    assert fsdp.explanation.fits and fsdp.memory_bytes > fsdp.explanation.hbm_capacity
    assert "memory/device (upper bound)" in str(plan) and "headroom (at least)" in str(plan)
    assert fsdp.to_dict()["memory_upper_bound_bytes"] == fsdp.memory_bytes


def test_a_program_the_compiler_refuses_reports_only_what_the_compiler_said():
    strategy = spmd.TPUStrategy(topology="v5e:2x2")

    def step(state, x):  # a 20 GiB output on every chip: over a v5e's 15.75 GiB
        return state, {"big": jnp.zeros((5 * GIB,), jnp.float32) + x.sum()}

    state = strategy.abstract_state(_create, jax.random.key(0))
    e = strategy.explain(step, state, X)
    assert e.fits is False and e.hbm_required >= 20 * GIB
    assert e.flops is None and e.peak_bytes is None and e.roofline is None
    text = str(e)
    assert "the compiler needs" in text and "DOES NOT FIT" in text
    assert re.search(r"peak \(upper bound\) +-\n", text) and re.search(r"FLOPs [^\n]+ +-\n", text)


def test_a_refused_candidate_is_null_in_json_not_zero(monkeypatch):
    def huge(key):
        return {"w": jax.random.normal(key, (256, 1024))}

    def step(state, x):
        return state, {"big": jnp.zeros((5 * GIB,), jnp.float32) + x.sum()}

    with pytest.raises(spmd.ConfigurationError, match="does not fit: the compiler needs") as info:
        spmd.auto_strategy(huge, step, X, "v5e:2x2", only="data parallel")
    assert "At least one layout fits" in str(info.value)
    plan = spmd.auto_strategy(_create, _step, X, "v5e:2x2", only="data parallel")[1]
    refused = dataclasses.replace(
        plan.best,
        explanation=_explanation(
            argument_bytes=None,
            output_bytes=None,
            alias_bytes=None,
            temp_bytes=None,
            flops=None,
            code_bytes=None,
            hbm_required=40 * GIB,
        ),
        roofline=None,
        dropped="does not fit",
    )
    data = json.loads(json.dumps(refused.to_dict()))
    assert data["memory_upper_bound_bytes"] is None and data["flops"] is None
    assert data["step_seconds"] is None and data["compiler_needs_bytes"] == 40 * GIB
