"""Planning fast: candidates compiled side by side, each program once per target, what a bound
rules out never compiled, a line per candidate as it is settled."""

import json

import jax
import jax.numpy as jnp
import optax
import pytest

import spmd
from spmd._src import plan_cache, plan_compile

pytestmark = pytest.mark.cpu_mesh

libtpu = pytest.importorskip("libtpu", reason="the TPU compiler (the tpu-compile extra)")


def _create(key):
    k1, k2 = jax.random.split(key)
    params = {
        "w1": jax.random.normal(k1, (256, 1024)) * 0.02,
        "w2": jax.random.normal(k2, (1024, 256)) * 0.02,
    }
    return {"params": params, "opt": optax.adam(1e-3).init(params)}


def _step(state, x):
    def loss(p):
        return ((jnp.tanh(x @ p["w1"]) @ p["w2"] - x) ** 2).mean()

    value, grads = jax.value_and_grad(loss)(state["params"])
    updates, opt = optax.adam(1e-3).update(grads, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, {"loss": value}


X = jax.ShapeDtypeStruct((64, 256), jnp.float32)
ONLY = ["data parallel", "FSDP over 4"]


@pytest.fixture
def compiles(monkeypatch):
    """The compiles a plan runs, by count."""
    count = [0]
    real = plan_compile.compile_lowered

    def counted(lowered):
        count[0] += 1
        return real(lowered)

    monkeypatch.setattr(plan_compile, "compile_lowered", counted)
    return count


@pytest.mark.slow  # 3 s of CPU: three compiles, then the cache
def test_a_second_plan_of_the_same_program_compiles_nothing(tmp_path, compiles):
    seen = []
    _, first = spmd.auto_strategy(
        _create,
        _step,
        X,
        "v5e:2x2",
        only=ONLY,
        cache_dir=tmp_path,
        progress=lambda c, how: seen.append((c.name, how)),
    )
    assert compiles[0] == 2 and len(list(tmp_path.glob("*.json"))) == 2
    assert all(how.startswith("compiled in ") for name, how in seen if "host" not in name)
    seen.clear()
    _, second = spmd.auto_strategy(
        _create,
        _step,
        X,
        "v5e:2x2",
        only=ONLY,
        cache_dir=tmp_path,
        progress=lambda c, how: seen.append((c.name, how)),
    )
    assert compiles[0] == 2  # nothing compiled the second time
    assert str(second) == str(first) and second.to_dict() == first.to_dict()
    assert sorted(how for _, how in seen) == ["from the cache"] * 2 + ["not compiled"]
    spmd.auto_strategy(_create, _step, X, "v5e:2x4", only="data parallel", cache_dir=tmp_path)
    assert compiles[0] == 3  # another target is another key


@pytest.mark.slow  # 3 s of CPU: four compiles
def test_compiling_in_parallel_gives_the_serial_plan(compiles):
    _, serial = spmd.auto_strategy(_create, _step, X, "v5e:2x2", only=ONLY, jobs=1)
    _, parallel = spmd.auto_strategy(_create, _step, X, "v5e:2x2", only=ONLY, jobs=2)
    assert compiles[0] == 4
    assert parallel.to_dict() == serial.to_dict() and str(parallel) == str(serial)


def test_an_offload_candidate_whose_mesh_fits_without_it_is_not_compiled(compiles):
    _, plan = spmd.auto_strategy(_create, _step, X, "v5e:2x2", only="FSDP over 4")
    offload = next(c for c in plan.candidates if "host memory" in c.name)
    assert offload.dropped.startswith("cannot help (not compiled): FSDP over 4 fits")
    assert offload.explanation is None and compiles[0] == 1


def test_a_state_over_hbm_is_dropped_without_compiling(compiles):
    def create(key):  # 20 GiB of float32 weights on every chip, replicated
        return {"w": jax.random.normal(key, (5 << 30,))}

    with pytest.raises(spmd.ConfigurationError, match="its state alone is 20.00 GiB") as info:
        spmd.auto_strategy(create, lambda s, x: (s, {}), X, "v5e:2x2", only="data parallel")
    assert "does not fit (not compiled)" in str(info.value) and compiles[0] == 0


@pytest.mark.parametrize(
    ("kwargs", "said"),
    [({"jobs": 0}, "jobs"), ({"jobs": 1.5}, "jobs"), ({"cache_dir": 7}, "cache_dir is a")],
)
def test_bad_jobs_or_cache_dir_are_clear_errors(kwargs, said):
    with pytest.raises(spmd.ConfigurationError, match=said) as info:
        spmd.auto_strategy(_create, _step, X, "v5e:2x2", only="data parallel", **kwargs)
    assert "To fix" in str(info.value)


def test_default_jobs_is_bounded_by_cores_and_free_memory(monkeypatch):
    monkeypatch.setattr(plan_compile.os, "cpu_count", lambda: 16)
    monkeypatch.setattr(plan_compile, "_available_memory", lambda: 5 * plan_compile.COMPILE_MEMORY)
    assert plan_compile.default_jobs() == 5
    monkeypatch.setattr(plan_compile, "_available_memory", lambda: 0)
    assert plan_compile.default_jobs() == 1
    monkeypatch.setattr(plan_compile, "_available_memory", lambda: None)
    assert plan_compile.default_jobs() == 16


def test_a_cache_that_cannot_be_written_warns_and_the_plan_goes_on(tmp_path, compiles):
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    with pytest.warns(UserWarning, match="cannot be written"):
        _, plan = spmd.auto_strategy(
            _create, _step, X, "v5e:2x2", only="data parallel", cache_dir=blocked / "plan"
        )
    assert plan.best.name == "data parallel" and compiles[0] == 1


@pytest.mark.slow  # 2 s of CPU: two compiles
def test_a_damaged_cache_entry_is_compiled_again(tmp_path, compiles):
    spmd.auto_strategy(_create, _step, X, "v5e:2x2", only="data parallel", cache_dir=tmp_path)
    (entry,) = tmp_path.glob("*.json")
    entry.write_text(entry.read_text()[:100])  # cut short, as by a killed run
    _, plan = spmd.auto_strategy(
        _create, _step, X, "v5e:2x2", only="data parallel", cache_dir=tmp_path
    )
    assert compiles[0] == 2 and plan.best.dropped is None


@pytest.mark.parametrize(
    "damage",
    [
        lambda e: e.update(temp_bytes=-(10**12)),  # a figure changed: the plan would lie
        lambda e: e.update(temp_bytes="12"),
        lambda e: e.update(dict.fromkeys(e)),
    ],
    ids=["a changed figure", "a figure of another type", "every figure null"],
)
def test_an_entry_changed_on_disk_is_compiled_again(tmp_path, damage):
    output = plan_compile.CompilerOutput(1, 2, 0, 3, 4, 5.0, 6.0, "HloModule m")
    plan_cache.store(tmp_path, "key", output)
    assert plan_cache.load(tmp_path, "key") == output
    (entry,) = tmp_path.glob("*.json")
    digest, _, text = entry.read_text().partition("\n")
    figures = json.loads(text)
    damage(figures)
    entry.write_text(f"{digest}\n{json.dumps(figures)}")
    assert plan_cache.load(tmp_path, "key") is None
