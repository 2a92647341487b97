"""`linearize bench kernels` (linearize/bench/kernels.py) on CPU: the order of the work (each row compiled, checked,
timed, printed and saved before the next kernel compiles), the --check modes, the progress lines, the default rows
and the flags that add the others, the JSON written as rows come, and the command's one-line errors. Fake row specs
and timers stand in for the GPU; the real specs run on the PyTorch paths at tiny shapes."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from linearize.bench import kernels as bk
from linearize.cli import app
from linearize.kernels import gated_delta_rule, gated_delta_rule_step, linear_attention, linear_attention_step

FAST = lambda fn: (fn(), 1.0)[1]  # noqa: E731 - a timer: one call, 1 ms


def fake_spec(name: str, log: list, *, passes=("fwd", "fwd+bwd"), err: float = 0.0, first_call="compiling",
              groups=frozenset(), fla=(), decode=False, boom=None):
    """A row spec whose calls, checks and builds are recorded in ``log``; ``boom`` (a pass name) raises
    KeyboardInterrupt at that pass's first call, as a user's Ctrl-C would."""

    def build(ctx, B, T):
        log.append(f"build {name} T={T}")

        def timed(p):
            def fn():
                if p == boom:
                    raise KeyboardInterrupt
                log.append(f"call {name} {p} T={T}")

            def check():
                log.append(f"check {name} {p} T={T}")
                return [("out", err, 1e-2)]

            return bk.Timed(fn=fn, check=check, no_grad=p == "fwd")

        return {p: timed(p) for p in passes}

    return bk.RowSpec("bench-" + name, name, f"kernel {name}", build, frozenset(groups), tuple(fla), decode=decode,
                      first_call=first_call)


def run(specs, log, **kw):
    kw = {"lengths": [2048, 8192], "tokens": 32768, "heads": 2, "dim": 16, "device": "cpu", "timer": FAST,
          "progress": lambda m: log.append("say " + m), **kw}
    return bk.bench_kernels(specs=specs, **kw)


def test_each_row_is_printed_before_the_next_kernel_compiles():
    """The first row (the first spec's forward at the smallest T) is compiled, checked, timed and printed before
    anything else compiles; then the next pass, the next spec, the next length; decode rows last."""
    log = []
    run([fake_spec("a", log), fake_spec("b", log), fake_spec("d", log, passes=("step",), decode=True)], log)
    work = [m for m in log if not m.startswith("say bench kernels") and not m.startswith("say each kernel")]
    first_row = next(i for i, m in enumerate(work) if m.startswith("say bench-a") and "fwd " in m)
    assert work[0].startswith("say copy           torch copy_") and work[1:first_row + 1] == [
        "build a T=2048", "say compiling kernel a: forward (T=2K, B=16) ...", "call a fwd T=2048",
        "check a fwd T=2048", "call a fwd T=2048", work[first_row]]
    assert "T=2K" in work[first_row] and "B=16" in work[first_row] and "check ok" in work[first_row]
    calls = [m for m in log if m.startswith(("call", "check"))]
    order = list(dict.fromkeys(m.rsplit(" ", 1)[0].replace("check", "call") + " " + m.rsplit(" ", 1)[1]
                               for m in calls))
    assert order == ["call a fwd T=2048", "call a fwd+bwd T=2048", "call b fwd T=2048", "call b fwd+bwd T=2048",
                     "call a fwd T=8192", "call a fwd+bwd T=8192", "call b fwd T=8192", "call b fwd+bwd T=8192",
                     "call d step T=1"]
    # every pass's row is printed before the next pass's first call
    for before, after in zip(order, order[1:]):
        name, p, T = before.split()[1:]
        row = next(i for i, m in enumerate(log) if m.startswith(f"say bench-{name}") and f" {p} " in m
                   and f"T={bk.format_length(int(T[2:])) if int(T[2:]) >= 1024 else T[2:]} " in m)
        assert row < log.index(after)


def test_progress_names_what_compiles_and_stays_off_the_rows():
    """A 'compiling ...' line before each pass's first call, naming the kernel, pass and shape; none for kernels
    that ship compiled (SDPA); the first real row reads as the brief's example."""
    log = []
    run([fake_spec("a", log), fake_spec("sdpa", log, first_call="")], log, lengths=[32768])
    said = [m[4:] for m in log if m.startswith("say ")]
    assert "compiling kernel a: forward (T=32K, B=1) ..." in said
    assert "compiling kernel a: forward+backward (T=32K, B=1) ..." in said
    assert not any("kernel sdpa" in m for m in said)
    assert any(m.startswith("bench-sdpa") for m in said)
    assert said[0].startswith("bench kernels: T=32K (B*T=32768), 2 kinds of rows per length, 0 decode rows, check "
                              "quick; off: gated, delta, hedgehog, unnorm (--gated, --delta, --hedgehog, --full)")

    log = []
    bk.bench_kernels(specs=bk.ROW_SPECS[:1], lengths=[2048], tokens=2048, heads=1, dim=16, device="cpu",
                     dtype=torch.float32, timer=FAST, progress=log.append, decode=False)
    i = log.index("compiling linear attention (ours): forward (T=2K, B=1) ...")
    assert log[i + 1].startswith("linear         ours                         T=2K    B=1   fwd         1.0000 ms  "
                                 "(first call ") and "check ok" in log[i + 1]


@pytest.mark.parametrize("mode", ["quick", "none", "accuracy", "full"])
def test_check_modes(monkeypatch, mode):
    """quick: each pass checked once, at the first length it runs at; none: never; accuracy / full: the quick
    checks, then the long-sequence checks or the whole sweep after the last row (never before the first)."""
    log = []
    monkeypatch.setattr(bk, "_check_accuracy", lambda device: log.append("accuracy sweep") or
                        [{"check": "accuracy linear", "ok": True, "rel_err": 1e-3}])

    def sweep(device, report=None):
        log.append("full sweep")
        rows = [{"check": "linear (2, 1000)", "ok": True}, {"check": "window (1, 500)", "ok": False, "error": "x"}]
        for r in rows:
            report(r)
        return rows

    monkeypatch.setattr(bk, "check_kernels", sweep)
    res = run([fake_spec("a", log), fake_spec("d", log, passes=("step",), decode=True)], log, check=mode)
    checks = [r for r in res if "check" in r]
    quick = [m for m in log if m.startswith("check ")]
    if mode == "none":
        assert quick == [] and checks == []
    else:
        assert quick == ["check a fwd T=2048", "check a fwd+bwd T=2048", "check d step T=1"]
        assert [c["check"] for c in checks[:3]] == ["quick bench-a a fwd T=2K, B=16", "quick bench-a a fwd+bwd T=2K, B=16",
                                                    "quick bench-d d step T=1, B=8"]
        assert all(c["ok"] and c["rel_err"] == 0.0 for c in checks[:3])
    sweeps = [i for i, m in enumerate(log) if m.endswith("sweep")]
    last_call = max(i for i, m in enumerate(log) if m.startswith("call "))
    assert [log[i] for i in sweeps] == {"quick": [], "none": [], "accuracy": ["accuracy sweep"],
                                        "full": ["full sweep"]}[mode]
    assert all(i > last_call for i in sweeps)
    if mode == "full":
        assert [c["ok"] for c in checks[3:]] == [True, False]
        assert any(m.startswith("say check window (1, 500): FAIL") for m in log)


def test_a_failed_quick_check_is_reported_and_the_row_still_timed():
    log = []
    res = run([fake_spec("a", log, passes=("fwd",), err=0.5)], log, lengths=[2048])
    (c,) = [r for r in res if "check" in r]
    assert not c["ok"] and c["rel_err"] == 0.5 and c["error"] == "out relative error 5.00e-01 > 1e-02"
    assert [r["impl"] for r in res if r.get("bench") == "bench-a"] == ["a"]
    assert any("check FAILED out relative error" in m for m in log)


def test_bad_check_mode_is_one_clear_error():
    from linearize.errors import LinearizeError

    with pytest.raises(LinearizeError, match="--check 'fast': expected one of quick, accuracy, full, none"):
        run([], [], check="fast")


def test_rows_are_saved_as_they_come(tmp_path):
    """-o: the JSON is rewritten after every row, so a run stopped in the middle (here a Ctrl-C at the second
    spec's first call) keeps every row it finished, marked incomplete; a whole run is marked complete."""
    out = tmp_path / "bench.json"
    log = []
    with pytest.raises(KeyboardInterrupt):
        run([fake_spec("a", log), fake_spec("b", log, boom="fwd")], log, out_json=out)
    blob = json.loads(out.read_text())
    assert blob["complete"] is False and set(blob) == {"meta", "checks", "rows", "complete"}
    assert [(r["bench"], r["impl"], r["passes"]) for r in blob["rows"]] == [
        ("copy", "torch copy_", "-"), ("bench-a", "a", "fwd"), ("bench-a", "a", "fwd+bwd")]
    assert [c["check"] for c in blob["checks"]] == ["quick bench-a a fwd T=2K, B=16", "quick bench-a a fwd+bwd T=2K, B=16"]
    row = blob["rows"][1]
    assert {"bench", "impl", "T", "B", "passes", "ms", "first_call_s"} <= set(row) and (row["T"], row["B"]) == (2048, 16)
    assert blob["meta"]["check"] == "quick" and blob["meta"]["lengths"] == [2048, 8192]

    res = run([fake_spec("a", log)], log, out_json=out)
    blob = json.loads(out.read_text())
    assert blob["complete"] is True and len(blob["rows"]) == 1 + 4
    assert [r for r in res if "bench" in r] == blob["rows"]


def test_default_rows_and_the_flags_that_add_the_others():
    """Default: ours linear and window (first), SDPA, fla when it is installed (after ours), decode steps;
    --gated adds our gated kernels and fla's chunk_simple_gla and chunk_gla; --delta the gated delta rule, ours
    and fla's, sequence and decode step; --hedgehog the Hedgehog widths and fused features; --full everything;
    --no-fla leaves fla out."""
    names = lambda specs: [(s.bench, s.impl) for s in specs]  # noqa: E731
    fla = bk.FlaOps(installed=True)
    assert bk.row_groups() == {"fla"} and bk.row_groups(fla=False) == set()
    assert bk.row_groups(full=True) == set(bk.ROW_GROUPS) and bk.row_groups(gated=True, fla=False) == {"gated"}
    assert bk.row_groups(delta=True) == {"fla", "delta"} and bk.row_groups(delta=True, fla=False) == {"delta"}
    assert "delta" in bk.row_groups(full=True, fla=False)
    default = bk.select_rows(bk.ROW_SPECS, bk.row_groups(), fla)
    assert names(default) == [
        ("linear", "ours"), ("window", "ours W={window}"), ("linear", "sdpa-flash"), ("linear", "sdpa-cudnn"),
        ("linear", "fla"), ("linear", "fla-unnorm"), ("decode", "ours linear step"), ("decode", "fla fused_recurrent"),
        ("decode", "ours window step W={window}")]
    assert names(bk.select_rows(bk.ROW_SPECS, bk.row_groups(), bk.FlaOps(installed=False))) == [
        n for n in names(default) if not n[1].startswith("fla")]
    gated = names(bk.select_rows(bk.ROW_SPECS, bk.row_groups(gated=True), fla))
    assert [n for n in gated if n not in names(default)] == [
        ("linear gated", "ours"), ("linear gated", "ours-unnorm"), ("linear gated", "fla simple_gla"),
        ("linear gated", "fla gla"), ("decode", "ours gated linear step")]
    delta = names(bk.select_rows(bk.ROW_SPECS, bk.row_groups(delta=True), fla))
    assert [n for n in delta if n not in names(default)] == [
        ("gated delta", "ours"), ("gated delta", "fla"), ("decode", "ours gated delta step"),
        ("decode", "fla fused_recurrent delta")]
    assert [n for n in names(bk.select_rows(bk.ROW_SPECS, bk.row_groups(delta=True, fla=False), fla))
            if n not in names(default)] == [("gated delta", "ours"), ("decode", "ours gated delta step")]
    hedgehog = names(bk.select_rows(bk.ROW_SPECS, bk.row_groups(hedgehog=True), fla))
    assert [n for n in hedgehog if n not in names(default)] == [
        ("linear K={hedgehog_dim}", "ours"), ("linear K={hedgehog_dim}", "fla"),
        ("linear K={hedgehog_dim}", "ours fused hedgehog"), ("window K={hedgehog_dim}", "ours W={window}"),
        ("window", "ours W={window} fused hedgehog")]
    assert bk.select_rows(bk.ROW_SPECS, bk.row_groups(full=True), fla) == bk.ROW_SPECS
    assert len(set(names(bk.ROW_SPECS))) == len(bk.ROW_SPECS)
    assert bk.DEFAULT_LENGTHS == (2048, 8192, 32768) and bk.FULL_LENGTHS[-1] == 131072


def _fake_fla():
    """fla's functions as the rows call them, on our PyTorch path (to check the arguments the rows pass)."""
    calls = []

    def chunk_linear_attn(q, k, v, scale, normalize):
        calls.append("chunk_linear_attn")
        assert scale == 1.0
        return linear_attention(q, k, v, normalize=normalize, backend="torch")[0], None

    def chunk_simple_gla(q, k, v, g, scale):
        calls.append("chunk_simple_gla")
        assert g.shape == q.shape[:3] and scale == 1.0
        return linear_attention(q, k, v, normalize=False, log_decay=g, backend="torch")[0], None

    def chunk_gla(q, k, v, g, scale):
        calls.append("chunk_gla")
        assert g.shape == q.shape and g.is_contiguous() and scale == 1.0
        return linear_attention(q, k, v, normalize=False, log_decay=g.mean(-1), backend="torch")[0], None

    def fused_recurrent_linear_attn(q, k, v, scale, initial_state, output_final_state):
        calls.append("fused_recurrent_linear_attn")
        S = initial_state + torch.einsum("bthk,bthv->bhkv", k.float(), v.float())
        return torch.einsum("bthk,bhkv->bthv", q.float(), S).to(v.dtype), S

    def unit(x):  # L2-normalised per head, as the layer gives q and k
        return torch.allclose(x.float().norm(dim=-1), torch.ones(x.shape[:-1]), atol=1e-3)

    # fla 0.6.0's signatures (fla.ops.gated_delta_rule): q, k [B, T, H, K] (as many heads: no GQA), v [B, T, H, V],
    # g (log decays) and beta [B, T, H]
    def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False):
        calls.append("chunk_gated_delta_rule")
        assert q.shape == k.shape and v.shape[:3] == g.shape == beta.shape == q.shape[:3], (q.shape, k.shape, g.shape)
        assert g.dtype == torch.float32 and bool((g <= 0).all()) and bool(((beta > 0) & (beta < 1)).all())
        assert scale == q.shape[-1] ** -0.5 and unit(q) and unit(k) and initial_state is None
        return gated_delta_rule(q, k, v, beta, g, scale=scale, backend="torch")[0], None

    def fused_recurrent_gated_delta_rule(q, k, v, g=None, gk=None, gv=None, beta=None, scale=None,
                                         initial_state=None, output_final_state=False):
        calls.append("fused_recurrent_gated_delta_rule")
        B, T, H, K = q.shape
        assert T == 1 and k.shape == q.shape and v.shape[:3] == g.shape == beta.shape == (B, 1, H)
        assert initial_state.shape == (B, H, K, v.shape[-1]) and initial_state.dtype == torch.float32
        assert scale == K ** -0.5 and unit(q) and unit(k) and output_final_state and gk is None and gv is None
        S = initial_state.clone()  # fla returns a new state
        o = gated_delta_rule_step(q[:, 0], k[:, 0], v[:, 0], beta[:, 0], g[:, 0], S, scale=scale, backend="torch")
        return o.unsqueeze(1), S

    ops = {f.__name__: f for f in (chunk_linear_attn, chunk_simple_gla, chunk_gla, fused_recurrent_linear_attn,
                                   chunk_gated_delta_rule, fused_recurrent_gated_delta_rule)}
    return ops, calls


def test_every_row_kind_runs_on_the_pytorch_paths(tmp_path):
    """Each spec of --full, built at tiny shapes on CPU (our kernels on their PyTorch paths, fla's functions faked
    on them): rows for every kind and pass, every quick check passes, the summary reads them (with the chunk_gla
    ratios), and the table prints. SDPA's backends are CUDA's only: no rows here."""
    ops, calls = _fake_fla()
    out = tmp_path / "bench.json"
    res = bk.bench_kernels(out, lengths=[64, 128], tokens=128, heads=2, dim=16, window=8, hedgehog_dim=32,
                           decode_batch=2, groups=bk.row_groups(full=True), fla_ops=ops, device="cpu",
                           dtype=torch.float32, timer=FAST)
    rows = [r for r in res if "bench" in r]
    assert not [r for r in rows if r["bench"] == "error"]
    kinds = {(r["bench"], r["impl"]) for r in rows}
    ctx = bk.BenchContext(heads=2, dim=16, window=8, hedgehog_dim=32, device=torch.device("cpu"),
                          dtype=torch.float32, fla=ops)
    assert kinds == {("copy", "torch copy_")} | {s.names(ctx) for s in bk.ROW_SPECS if "sdpa" not in s.impl}
    assert {r["passes"] for r in rows if r["bench"] == "decode"} == {"step"}
    assert all(r["passes"] == "fwd" for r in rows if "fused hedgehog" in r["impl"])
    assert len([r for r in rows if r["impl"] == "fla gla"]) == 4  # fwd, fwd+bwd at both lengths
    assert set(calls) == set(ops)
    checks = [r for r in res if "check" in r]
    assert checks and all(c["ok"] for c in checks), [c for c in checks if not c["ok"]]
    assert len(checks) == len({(c["check"].split(" T=")[0]) for c in checks})  # each pass once
    assert not any("fla" in c["check"] for c in checks)  # fla's kernels are timed, not checked
    (s64, s128) = bk.summarize(rows)
    assert s64["T"] == 64 and s64["gated unnorm fwd vs fla gla"] == pytest.approx(1.0)
    assert s64["gated unnorm fwd+bwd vs fla simple_gla"] == pytest.approx(1.0)
    assert s128["delta fwd vs fla"] == pytest.approx(1.0) and s128["delta fwd+bwd vs fla"] == pytest.approx(1.0)
    assert json.loads(out.read_text())["complete"] is True
    bk.print_table(res)


def _ctx(ops, heads=2, dim=16):
    return bk.BenchContext(heads=heads, dim=dim, window=8, hedgehog_dim=32, device=torch.device("cpu"),
                           dtype=torch.float32, fla=ops)


@pytest.mark.parametrize("kv_heads", [None, 1])
def test_delta_rows_on_the_pytorch_paths(kv_heads):
    """--delta's specs built at a tiny shape (fla faked with its 0.6.0 signatures, which check the arguments'
    names, shapes and dtypes): ours and fla's forward give the same output; fwd+bwd's check covers the output and
    the gradients of q, k, v, beta and log_decay; the decode steps: ours updates each state in place and is
    checked on its output and state, fla's gets the state as initial_state; GQA (kv_heads, the lab script's HK)
    repeats the KV heads for fla."""
    ops, calls = _fake_fla()
    ctx = _ctx(ops, heads=2)
    ours, fla, step, fla_step = bk.delta_row_specs(kv_heads)
    assert (ours.bench, fla.impl) == ("gated delta" + (" Hk=1" if kv_heads else ""), "fla")
    torch.manual_seed(0)
    p_ours, p_fla = ours.build(ctx, 2, 70), fla.build(ctx, 2, 70)
    assert set(p_ours) == set(p_fla) == {"fwd", "fwd+bwd"} and p_ours["fwd"].no_grad
    with torch.no_grad():
        o, of = p_ours["fwd"].fn(), p_fla["fwd"].fn()
    assert o.shape == of.shape == (2, 70, 2, 16) and bk.rel_err(o, of) > 0  # their own random inputs
    assert [n for n, _, _ in p_ours["fwd+bwd"].check()] == ["out", "dq", "dk", "dv", "dbeta", "dlog_decay"]
    assert all(err <= tol for _, err, tol in p_ours["fwd+bwd"].check() + p_ours["fwd"].check())
    p_fla["fwd+bwd"].fn()
    assert p_fla["fwd"].check is None and calls == ["chunk_gated_delta_rule"] * 2

    ctx.copy_gbs = 100.0
    s_ours, s_fla = step.build(ctx, 3, 1)["step"], fla_step.build(ctx, 3, 1)["step"]
    s_ours.warm()
    s_ours.fn()
    checks = s_ours.check()
    assert [n for n, _, _ in checks] == ["out", "S"] and all(err <= tol for _, err, tol in checks)
    s_fla.warm()
    assert calls.count("fused_recurrent_gated_delta_rule") == bk.NROT
    Hk = kv_heads or 2
    assert s_ours.fields(1.0)["gbs"] == pytest.approx(2 * 3 * Hk * 16 * 16 * 4 / 1e6)
    assert s_fla.fields(1.0)["gbs"] == pytest.approx(2 * 3 * 2 * 16 * 16 * 4 / 1e6)  # fla's state: every head


def test_our_delta_step_row_rotates_states_in_place(monkeypatch):
    """Each timed call steps all NROT fp32 states, each in place (its own, one after another) into one output
    buffer: the decode row's bytes are those states read and written."""
    seen = []

    def spy(q, k, v, beta, log_decay, state, **kw):
        before = state.clone()
        o = gated_delta_rule_step(q, k, v, beta, log_decay, state, **kw)
        seen.append((state.data_ptr(), kw.get("out") is not None, not torch.equal(before, state)))
        return o

    monkeypatch.setattr(bk, "gated_delta_rule_step", spy)
    ops, _ = _fake_fla()
    timed = bk.delta_row_specs()[2].build(_ctx(ops), 2, 1)["step"]
    timed.warm()  # the first call of each (where Triton compiles), outside a CUDA graph
    seen.clear()
    timed.fn()
    assert timed.calls == bk.NROT and len(seen) == bk.NROT and len({p for p, _, _ in seen}) == bk.NROT
    assert all(out and moved for _, out, moved in seen)


def test_summary_has_the_delta_ratios_per_length(capsys):
    """fla's ms / ours for the delta rows, fwd and fwd+bwd, at each length; the decode line for the delta steps."""
    row = lambda b, i, T, p, ms: {"bench": b, "impl": i, "T": T, "B": 32768 // T, "passes": p, "ms": ms}  # noqa
    rows = [row("linear", "ours", 2048, "fwd", 1.0),
            row("gated delta", "ours", 2048, "fwd", 2.0), row("gated delta", "fla", 2048, "fwd", 3.0),
            row("gated delta", "ours", 2048, "fwd+bwd", 4.0), row("gated delta", "fla", 2048, "fwd+bwd", 10.0),
            row("gated delta", "ours", 8192, "fwd", 2.5), row("gated delta", "fla", 8192, "fwd", 2.0),
            row("decode", "ours gated delta step", 1, "step", 0.02),
            row("decode", "fla fused_recurrent delta", 1, "step", 0.05)]
    s2k, s8k = bk.summarize(rows)
    assert (s2k["T"], s8k["T"]) == (2048, 8192)
    assert s2k["delta fwd vs fla"] == pytest.approx(1.5) and s2k["delta fwd+bwd vs fla"] == pytest.approx(2.5)
    assert s8k["delta fwd vs fla"] == pytest.approx(0.8) and "delta fwd+bwd vs fla" not in s8k
    (only_fb,) = bk.summarize(rows[:2] + rows[3:5])  # no fla forward: no forward ratio
    assert "delta fwd vs fla" not in only_fb and only_fb["delta fwd+bwd vs fla"] == pytest.approx(2.5)
    bk.print_table([{"meta": {}}] + rows)
    out = capsys.readouterr().out
    assert "gated delta decode: ours 20.0 us vs fla 50.0 us = 2.50x" in out and "delta fwd vs fla" in out


def test_lab_script_bench_delta_times_variants_and_gqa_through_the_rows(monkeypatch, capsys):
    """kernels/bench_delta.py is the --delta rows plus its own options: CONFIG overrides, a row of ours per
    VARIANTS entry (each call under its overrides, restored after), HK (GQA, in the names), fla's rows checked;
    it ends with fla / ours per length and variant. Run on CPU at a tiny shape with fla faked."""
    import importlib.util
    from pathlib import Path

    from linearize.kernels import triton_delta, tuning

    path = Path(__file__).resolve().parents[1] / "kernels" / "bench_delta.py"
    spec = importlib.util.spec_from_file_location("bench_delta_lab", path)
    lab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lab)
    monkeypatch.setattr(triton_delta, "CONFIG", dict(triton_delta.CONFIG))
    monkeypatch.setattr(tuning, "ensure_applied", lambda device: None)
    ops, calls = _fake_fla()
    seen = []
    real_fla = ops["chunk_gated_delta_rule"]

    def fla_spy(*a, **kw):  # fla's calls see the configuration left as it was
        seen.append(("fla", triton_delta.CONFIG["walk_bv"], triton_delta.CONFIG["walk_warps"]))
        return real_fla(*a, **kw)

    ops["chunk_gated_delta_rule"] = fla_spy
    real_gdr = bk.gated_delta_rule

    def ours_spy(*a, **kw):
        seen.append(("ours", triton_delta.CONFIG["walk_bv"], triton_delta.CONFIG["walk_warps"]))
        return real_gdr(*a, **kw)

    monkeypatch.setattr(bk, "gated_delta_rule", ours_spy)
    real_bench = bk.bench_kernels
    monkeypatch.setattr(bk, "bench_kernels", lambda out, **kw: real_bench(
        out, **kw, tokens=128, heads=2, dim=16, device="cpu", dtype=torch.float32, timer=FAST, fla_ops=ops))
    for k, v in {"HK": "1", "LENGTHS": "64", "CONFIG": "walk_warps=4", "VARIANTS": "walk_bv=32; walk_bv=16"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr("sys.argv", ["bench_delta.py"])
    lab.main()
    out = capsys.readouterr().out
    assert triton_delta.CONFIG["walk_warps"] == 4 and triton_delta.CONFIG["walk_bv"] == 64  # CONFIG stays
    assert {x for x in seen if x[0] == "ours"} == {("ours", 64, 4), ("ours", 32, 4), ("ours", 16, 4)}
    assert {x for x in seen if x[0] == "fla"} == {("fla", 64, 4)}
    assert "quick gated delta Hk=1 fla fwd+bwd T=64, B=2" in out and "FAIL" not in out
    table = out[out.index("fla / ours (gated delta Hk=1"):].splitlines()[1:]
    assert [ln.split()[1] + " " + ln.split()[2] for ln in table] == ["ours fwd", "ours walk_bv=32", "ours walk_bv=16"]
    assert all("= 1.00x" in ln for ln in table)
    assert "fused_recurrent_gated_delta_rule" in calls


def test_format_row():
    row = {"bench": "decode", "impl": "ours linear step", "T": 1, "B": 8, "passes": "step", "ms": 0.0123,
           "gbs": 3400.4, "pct_copy": 80.2}
    assert bk.format_row(row) == ("decode         ours linear step             T=1     B=8   step        0.0123 ms  "
                                  "3400 GB/s (80% of copy)")
    assert "T=128K" in bk.format_row({**row, "T": 131072})


# ---------------------------------------------------------------------------
# the command


def cli(*args, env=None):
    return CliRunner().invoke(app, ["bench", "kernels", *args], env={"COLUMNS": "200", **(env or {})})


@pytest.mark.parametrize("args, message", [
    (["--check", "fast"], "--check 'fast': expected quick, accuracy, full, none"),
    (["--lengths", "2K,x"], "bad length 'x'"),
    (["--lengths", ","], "bad lengths ','"),
    (["--tokens", "0"], "--tokens 0: expected a positive whole number"),
    (["--hedgehog-dim", "-2"], "--hedgehog-dim -2: expected a positive whole number"),
    (["--tune-only", "lin_fwd,nope"], "unknown nope"),
])
def test_bad_options_one_line(args, message):
    r = cli(*args)
    assert r.exit_code == 2, (r.stdout, r.stderr)
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in r.stderr, lines
    assert r.stdout == ""


def test_no_gpu_is_one_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    r = cli("--lengths", "2K")
    assert r.exit_code == 2 and r.stderr.strip() == "error: bench kernels needs a CUDA GPU (none is visible)"


@pytest.mark.parametrize("args, lengths, groups", [
    ([], [2048, 8192, 32768], {"fla"}),
    (["--full"], [2048, 8192, 32768, 131072], {"fla", "gated", "delta", "hedgehog", "unnorm"}),
    (["--full", "--lengths", "4K"], [4096], {"fla", "gated", "delta", "hedgehog", "unnorm"}),
    (["--gated", "--no-fla", "--check", "none"], [2048, 8192, 32768], {"gated"}),
    (["--hedgehog", "--lengths", "32K,2K"], [2048, 32768], {"fla", "hedgehog"}),
    (["--delta"], [2048, 8192, 32768], {"fla", "delta"}),
    (["--delta", "--no-fla", "--lengths", "8K"], [8192], {"delta"}),
])
def test_command_passes_the_plan_and_keeps_progress_on_stderr(monkeypatch, tmp_path, args, lengths, groups):
    """The options reach bench_kernels (default: quick check, 2K/8K/32K, fla's rows); progress goes to stderr,
    the table to stdout."""
    seen = {}

    def fake(out, **kw):
        seen.update(kw, out=out)
        kw["progress"]("compiling linear attention (ours): forward (T=2K, B=16) ...")
        return [{"meta": {"gpu": "test"}}, {"bench": "linear", "impl": "ours", "T": 2048, "B": 16, "passes": "fwd",
                                            "ms": 0.5}]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bk, "bench_kernels", fake)
    out = tmp_path / "b.json"
    r = cli(*args, "-o", str(out))
    assert r.exit_code == 0, r.stderr
    assert seen["lengths"] == lengths and seen["groups"] == groups and seen["out"] == out
    assert seen["check"] == ("none" if "none" in args else "quick")
    assert "compiling linear attention" in r.stderr and "compiling" not in r.stdout
    assert "kernel timings" in r.stdout and "0.5000" in r.stdout and "kernel timings" not in r.stderr
