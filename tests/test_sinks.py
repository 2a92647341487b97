"""Attention sinks (``attention.sinks``): the kernels' spec and merge, the layers' cache, recipes, checkpoints."""

import pytest
import torch

from conftest import check_checkpoint_round_trip, tiny_model
from linearize import recipe as R
from linearize.convert.selection import select_layout
from linearize.convert.surgery import linearize_model
from linearize.kernels import window_linear_attention
from linearize.kernels.sinks import Sinks, first_tokens, gather_sinks, join_sinks, merge_sinks
from linearize.kernels.testing import check_sink_steps, leaves, window_inputs
from test_kernels_gated import F64, with_decay

NAMES = ("q", "k", "fq", "fk", "v")


def first_n(B: int, T: int, n: int, pad: int = 0) -> torch.Tensor:
    """``[B, T]`` bool: the first ``n`` positions after ``pad`` (row 1 only) are sinks."""
    m = torch.zeros(B, T, dtype=torch.bool)
    m[:, :n] = True
    if pad:
        m[1] = False
        m[1, pad:pad + n] = True
    return m


def test_reference_sinks_are_the_formula():
    """Query i: softmax over the window and over the sinks j <= i, linear over the other keys j <= i - W, one
    normaliser; the sinks add nothing to the final state. Written out for one head, float64."""
    B, T, H, Hk, D, K, V, W, n = 1, 12, 1, 1, 4, 3, 2, 3, 2
    x = window_inputs(B, T, H, Hk, D, K, V, dtype=F64, seed=3)
    q, k, fq, fk, v, wf = (x[a] for a in (*NAMES, "window_factor"))
    o, (S, z), lse = window_linear_attention(q, k, fq, fk, v, wf, window=W, backend="reference", return_lse=True,
                                             sink_mask=first_n(B, T, n), output_final_state=True)
    w = float(wf[0])
    for i in range(T):
        num, den = torch.zeros(V, dtype=F64), torch.zeros((), dtype=F64)
        for j in range(i + 1):
            if i - j < W or j < n:
                c = w * torch.exp(q[0, i, 0] @ k[0, j, 0] / D ** 0.5)
            else:
                c = (1 - w) * (fq[0, i, 0] @ fk[0, j, 0])
            num, den = num + c * v[0, j, 0], den + c
        torch.testing.assert_close(o[0, i, 0], num / (den + 1e-12), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lse[0, i, 0], torch.log(den + 1e-12), rtol=1e-12, atol=1e-12)
    S_want = sum(torch.outer(fk[0, j, 0], v[0, j, 0]) for j in range(n, T - W))
    torch.testing.assert_close(S[0, 0], S_want)
    torch.testing.assert_close(z[0, 0], fk[0, n:T - W, 0].sum(0))


@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("padded", [False, True], ids=["", "left-padded"])
def test_torch_path_matches_the_reference(gated, padded):
    """The chunked path plus the merge equals the quadratic spec: outputs, lse, final state and every gradient
    (lse's too), GQA, odd T, K != V, an initial state, a window of several chunks."""
    B, T, H, Hk, D, K, V, W = 2, 75, 4, 2, 8, 6, 5, 20
    inp = window_inputs(B, T, H, Hk, D, K, V, dtype=F64, seed=5, state=True)
    inp["window_factor"] = inp["window_factor"].double()
    if gated:
        inp = with_decay(inp, B, T, Hk, seed=6)
    key_mask = None
    if padded:
        key_mask = torch.ones(B, T, dtype=torch.bool)
        key_mask[1, :9] = False
    sinks = first_n(B, T, 4, pad=9 if padded else 0)
    results = []
    for backend in ("reference", "torch"):
        x = leaves(inp)
        o, st, lse = window_linear_attention(*(x[a] for a in NAMES), x["window_factor"], window=W, backend=backend,
                                             initial_state=x["initial_state"], output_final_state=True,
                                             key_mask=key_mask, log_decay=x.get("log_decay"), sink_mask=sinks,
                                             return_lse=True)
        g = torch.Generator().manual_seed(2)
        rows = key_mask if key_mask is not None else torch.ones(B, T, dtype=torch.bool)
        loss = sum((t * torch.randn(t.shape, generator=g, dtype=F64)).sum() for t in (*st,))
        loss = loss + (o * torch.randn(o.shape, generator=g, dtype=F64))[rows].sum()
        loss = loss + (lse * torch.randn(lse.shape, generator=g, dtype=F64))[rows].sum()
        loss.backward()
        results.append((o[rows], lse[rows], st, {a: t.grad for a, t in x.items() if a != "initial_state"},
                        [t.grad for t in x["initial_state"]]))
    (o_r, l_r, st_r, g_r, gs_r), (o_t, l_t, st_t, g_t, gs_t) = results
    torch.testing.assert_close(o_t, o_r, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(l_t, l_r, rtol=1e-10, atol=1e-10)
    for a, b in zip(st_t, st_r):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    for name in g_r:
        torch.testing.assert_close(g_t[name], g_r[name], rtol=1e-9, atol=1e-9, msg=name)
    for a, b in zip(gs_t, gs_r):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_sinks_change_only_the_queries_past_the_window():
    """Within the window a sink is a window key already: queries i < n + W are unchanged; later ones differ."""
    B, T, H, Hk, D, K, V, W, n = 1, 40, 2, 1, 8, 4, 4, 8, 3
    x = window_inputs(B, T, H, Hk, D, K, V, dtype=F64, seed=1)
    args = [x[a] for a in NAMES] + [x["window_factor"]]
    plain, _ = window_linear_attention(*args, window=W, backend="torch")
    # plain with the sinks' features zeroed: what the merge starts from
    with_sinks, _ = window_linear_attention(*args, window=W, backend="torch", sink_mask=first_n(B, T, n))
    cut = W  # query W is the first whose window has left token 0
    torch.testing.assert_close(with_sinks[:, :cut], plain[:, :cut], rtol=0, atol=0)
    assert (with_sinks[:, cut:] - plain[:, cut:]).abs().amax() > 1e-3


def test_merge_keeps_a_query_with_no_visible_sink_exactly():
    B, T, H, Hk, D, V, N = 2, 5, 4, 2, 8, 3, 4
    g = torch.Generator().manual_seed(0)
    o, lse, q = torch.randn(B, T, H, V, generator=g), torch.randn(B, T, H, generator=g), torch.randn(B, T, H, D, generator=g)
    s = Sinks(torch.randn(B, N, Hk, D, generator=g), torch.randn(B, N, Hk, V, generator=g),
              torch.arange(N).expand(B, N), torch.ones(B, N, dtype=torch.bool))
    visible = torch.zeros(B, T, N, dtype=torch.bool)
    visible[0, 3:, :2] = True
    out, lse2 = merge_sinks(o, lse, q, s, visible, torch.full((H,), 0.3), 0.35)
    assert torch.equal(out[1], o[1]) and torch.equal(out[0, :3], o[0, :3])
    torch.testing.assert_close(lse2[1], lse[1])
    assert (out[0, 3:] - o[0, 3:]).abs().amax() > 1e-3 and bool((lse2[0, 3:] > lse[0, 3:]).all())


def test_sink_bookkeeping_across_calls():
    """``first_tokens`` skips padding and continues a count; ``join_sinks`` appends a later call's sinks."""
    mask = torch.tensor([[False, False, True, True, True], [True, True, True, True, True]])
    is_sink = first_tokens(3, 2, 5, "cpu", key_mask=mask, before=torch.tensor([0, 2]))
    assert is_sink.tolist() == [[False, False, True, True, True], [True, False, False, False, False]]
    k = torch.arange(10.0).view(2, 5, 1, 1)
    first = gather_sinks(is_sink, 3, k, k, offset=7)
    assert first.pos.tolist() == [[9, 10, 11], [7, 8, 9]] and first.valid.tolist() == [[True] * 3, [True, False, False]]
    later = gather_sinks(torch.tensor([[False], [True]]), 3, torch.full((2, 1, 1, 1), -1.0), torch.zeros(2, 1, 1, 1),
                         offset=12)
    both = join_sinks(first, later)
    assert both.k[1, :2, 0, 0].tolist() == [5.0, -1.0] and both.valid[1].tolist() == [True, True, False]
    assert both.pos[1, :2].tolist() == [7, 12] and torch.equal(both.k[0], first.k[0])


@pytest.mark.parametrize("prefill", [3, 13])
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_decode_steps_with_sinks_match_the_reference(prefill, gated):
    """The PyTorch step adds the sinks out of its window to the softmax part: prefill + steps equal the float64
    reference's forward with the same sinks (fp32 steps, 1e-4), from before and after the sinks left the window."""
    check_sink_steps("torch", torch.float32, prefill=prefill, gated=gated)


def sink_hybrid(sinks: int = 3, window: int = 4, **extra):
    rec = R.load("lolcats", {"attention.window": window, "attention.sinks": sinks, **extra})
    return linearize_model(tiny_model("llama", layers=4, seed=0), select_layout(4, ratio="3:1"), rec).eval(), rec


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("prefill", [2, 17], ids=["prefill-shorter-than-the-sinks", "prefill-17"])
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_decode_equals_forward(prefill, gated, device):
    """Prefill, a multi-token continuation and single steps give one forward's logits, whether the sinks came in
    the prefill or in later steps (on a GPU: the Triton kernels, decode steps fused again once every row has its
    sinks); the sinks do change the logits."""
    extra = {"attention.decay": "learned", "attention.decay_half_life": 8.0} if gated else {}
    hybrid, _ = sink_hybrid(**extra)
    plain, _ = sink_hybrid(0, **extra)
    hybrid, plain = hybrid.to(device), plain.to(device)
    torch.manual_seed(1)
    ids = torch.randint(0, 128, (2, 30), device=device)
    with torch.no_grad():
        full = hybrid(ids).logits
        assert (full - plain(ids).logits).abs().amax() > 1e-3
        out = hybrid(ids[:, :prefill], use_cache=True)
        pieces, cache = [out.logits], out.past_key_values
        out = hybrid(ids[:, prefill:prefill + 6], past_key_values=cache, use_cache=True)
        pieces.append(out.logits)
        for t in range(prefill + 6, 30):
            out = hybrid(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
            pieces.append(out.logits)
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=2e-4, atol=2e-4)


def test_left_padded_generation_and_prompt_lookup():
    """A left-padded row generates what it generates alone (its sinks are its first real tokens); prompt-lookup
    decoding (which takes draft tokens back) generates what greedy decoding does."""
    hybrid, _ = sink_hybrid()
    torch.manual_seed(2)
    a, b = torch.randint(1, 128, (1, 24)), torch.randint(1, 128, (1, 18))
    batch = torch.cat([a, torch.cat([torch.zeros(1, 6, dtype=torch.long), b], 1)])
    mask = torch.ones_like(batch)
    mask[1, :6] = 0
    with torch.no_grad():
        both = hybrid.generate(batch, attention_mask=mask, max_new_tokens=8, do_sample=False)
        alone = hybrid.generate(b, max_new_tokens=8, do_sample=False)
        assert torch.equal(both[1, 6:], alone[0])
        looked = hybrid.generate(a, max_new_tokens=10, do_sample=False, prompt_lookup_num_tokens=3)
        assert torch.equal(looked, hybrid.generate(a, max_new_tokens=10, do_sample=False))


def test_checkpoint_round_trip(tmp_path):
    """The setting survives a checkpoint; the package's class and the bundled code load it and generate alike."""
    hybrid, rec = sink_hybrid()
    check_checkpoint_round_trip(hybrid, rec, tmp_path / "sinks", lambda layers: all(m.sinks == 3 for m in layers))


def test_recipe_refuses_sinks_without_a_window():
    with pytest.raises(R.RecipeError, match="attention.sinks = 4: sinks join the sliding window"):
        R.load("lolcats", {"attention.window": 0, "attention.sinks": 4})
    assert R.load("lolcats", {"attention.sinks": 16}).values["attention"]["sinks"] == 16
