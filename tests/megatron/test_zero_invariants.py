"""megatron_zero keeps what Megatron's finalize_model_grads does: a GPTModel with Megatron's defaults (word
embedding tied to the output layer) trained 2 steps under the flexible schedule equals the single-process model
(fp32, 1e-6), and the first stage's embedding and the last stage's output layer stay bit-identical; the same
with virtual stages, with TP 2 + sequence parallel, and with calculate_per_token_loss."""

import contextlib
import functools

import pytest
import torch

import tiny_gpt as gpt

SEQ, MBS, LR, CLIP = 16, 2, 0.1, 0.5
STEPS = 2  # the second step's forward runs on the parameters the first step's ZeRO update gathered
TIED_COPY = "output_layer.weight"


def per_token_loss(loss_mask, per_token):
    """Megatron's calculate_per_token_loss contract: (sum of token losses, token count, stats)."""
    total = (per_token.float() * loss_mask).sum()
    return total, loss_mask.sum().to(torch.int), {"lm loss": total.detach()}


def per_token_forward_step(data_iterator, model):
    batch = next(data_iterator)
    out = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return out, functools.partial(per_token_loss, batch["loss_mask"])


def data_of(dp_rank, step, m):
    return gpt.microbatches(m, MBS, SEQ, seed=1000 * step + dp_rank)


def layers_of(pp, vpp):
    """One transformer layer per (virtual) pipeline stage."""
    return pp * (vpp or 1)


def tied_zero_train(pp, vpp, tp, sp, per_token, stage, m, k, keep_invariants=True, steps=STEPS, mesh=None):
    """Train STEPS steps on this rank's part; returns its parameters by name (the last stage's copy of the
    embedding under TIED_COPY) with their TP split, and the tied copy's gradient norms counted. ``mesh``: the one
    already built for (tp, pp, vpp), else built here."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from l3plugin.megatron import forward_backward_pipelining_flexible
    from l3plugin.demo.model import global_name
    from l3plugin.megatron.zero import attach_to_schedule, megatron_zero
    from l3plugin.mesh.groups import init_mesh
    from megatron_cpu_shim import sequence_parallel_on_cpu

    mesh = mesh or init_mesh(tp=tp, pp=pp, vpp=vpp)
    r, v = mesh.coords["pp"], vpp or 1
    config = gpt.gpt_config(layers_of(pp, vpp), pp=pp, vpp=vpp, k=k, tensor_model_parallel_size=tp,
                            sequence_parallel=sp, calculate_per_token_loss=per_token)
    chunks = [gpt.build_gpt(config, pre_process=r == 0 and c == 0, post_process=r == pp - 1 and c == v - 1,
                            vp_stage=c if vpp else None, seq_len=SEQ, tp_size=tp,
                            tp_rank=ps.get_tensor_model_parallel_rank(), share_embeddings_and_output_weights=True,
                            pp_rank=r)
              for c in range(v)]
    params = [p for c in chunks for p in c.parameters()]
    zero = megatron_zero(chunks, torch.optim.SGD(params, lr=LR), stage=stage, clip_grad=CLIP, bucket_numel=3000)
    attach_to_schedule(config, zero)
    if not keep_invariants:  # megatron_zero before it kept them (the measured "before" of docs/zero.md)
        zero.grad_sums.clear()
        config.finalize_model_grads_func = None
    norms = []
    for step in range(steps):
        batches = data_of(mesh.coords["dp"], step, m)
        with sequence_parallel_on_cpu() if sp else contextlib.nullcontext():
            forward_backward_pipelining_flexible(
                forward_step_func=per_token_forward_step if per_token else gpt.forward_step,
                data_iterator=[iter(batches) for _ in chunks], model=chunks, num_microbatches=m, seq_length=SEQ,
                micro_batch_size=MBS)
        norms.append(float(zero.step()))
    zero.wait_param_gather()
    out = {}
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            key = TIED_COPY if name == TIED_COPY else global_name(chunk, name)
            split = p.partition_dim if getattr(p, "tensor_model_parallel", False) and tp > 1 else None
            out[key] = (p.detach().clone(), split)
    return {"params": out, "norms": norms, "coords": mesh.coords, "rank": dist.get_rank()}


def serial_train(dp, m, per_token, layers):
    """The same model in one piece (tied: one tensor serves both uses), every DP rank's micro-batches in order,
    plain torch: clip_grad_norm_ and SGD."""
    from l3plugin.mesh.groups import init_mesh

    init_mesh()  # one rank: no communication
    model = gpt.build_gpt(gpt.gpt_config(layers), seq_len=SEQ, share_embeddings_and_output_weights=True)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    norms = []
    for step in range(STEPS):
        batches = [b for d in range(dp) for b in data_of(d, step, m)]
        tokens = sum(float(b["loss_mask"].sum()) for b in batches)
        for b in batches:
            if per_token:
                out, reduce = per_token_forward_step(iter([b]), model)
                reduce(out)[0].div(tokens).backward()
            else:
                out, reduce = gpt.forward_step(iter([b]), model)
                reduce(out)[0].div(m * dp).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "norms": norms}


def assemble(results):
    """{name: full tensor} from every rank's pieces (TP slices concatenated in TP order), checking that the
    copies of one piece on other DP ranks are bit-identical; and the tied copy pairs (first, last stage)."""
    full, copies, tied_pairs = {}, {}, []
    for res in sorted(results, key=lambda x: (x["coords"]["dp"], x["coords"]["pp"], x["coords"]["tp"])):
        c = res["coords"]
        for name, (t, split) in res["params"].items():
            if name == TIED_COPY:
                continue
            key = (name, c["tp"] if split is not None else 0)
            if key in copies:
                assert torch.equal(copies[key], t), f"{name} differs across DP ranks (rank {res['rank']})"
            copies[key] = t
        if TIED_COPY in res["params"]:
            first = next(x for x in results if x["coords"]["pp"] == 0
                         and all(x["coords"][d] == c[d] for d in ("tp", "dp", "cp")))
            tied_pairs.append((first["params"]["embedding.word_embeddings.weight"][0], res["params"][TIED_COPY][0],
                               res["rank"], first["rank"]))
    splits = {n: s for res in results for n, (_, s) in res["params"].items()}
    for name in {n for n, _ in copies}:
        parts = [copies[(name, i)] for i in sorted(i for n, i in copies if n == name)]
        full[name] = parts[0] if splits[name] is None else torch.cat(parts, splits[name])
    return full, tied_pairs


def tied_zero_train_cases(cases):
    """``tied_zero_train(*case)`` for each case in turn on this rank, the mesh built again only where (pp, vpp, tp)
    change."""
    from l3plugin.mesh.groups import init_mesh

    out, mesh, shape = [], None, None
    for case in cases:
        if case[:3] != shape:
            shape = case[:3]
            mesh = init_mesh(tp=shape[2], pp=shape[0], vpp=shape[1])
        out.append(tied_zero_train(*case, mesh=mesh))
    return out


def serial_train_cases(cases):
    return [serial_train(*case) for case in cases]


WORLD = 4
# tied_zero_train's arguments (pp, vpp, tp, sp, per_token, stage, m, k[, keep_invariants, steps]) of every test below,
# in mesh order. ZeRO-1 at pp 2 x dp 2: the per-token test; the tied-embedding test there is ZeRO-2 with two rounds
# (m 4, k 2), the TP and per-token tests one round (m 2).
TIED = (2, None, 1, False, False, 2, 4, 2)
PER_TOKEN = (2, None, 1, False, True, 1, 2, 2)
NO_SUMS = (2, None, 1, False, False, 1, 4, 2, False, 1)  # one step
VIRTUAL = (2, 2, 1, False, False, 2, 3, 2)  # two rounds per chunk (2 + 1 micro-batches)
TP_SP = (2, None, 2, True, False, 2, 2, 2)
CASES = [TIED, PER_TOKEN, NO_SUMS, VIRTUAL, TP_SP]


def serial_case(case):
    """serial_train's arguments for the single-process run ``case`` is compared with."""
    pp, vpp, tp, _, per_token, _, m, _ = case[:8]
    return WORLD // (pp * tp), m, per_token, layers_of(pp, vpp)


@pytest.fixture(scope="module")
def trained(ranks):
    """{case: every rank's tied_zero_train result} for CASES, and {("serial", case): the single-process run} for
    the compared ones: one call to the ranks for all, one to the single process."""
    done = dict(zip(CASES, zip(*ranks.run(WORLD, tied_zero_train_cases, CASES, timeout=300))))
    compared = [case for case in CASES if case is not NO_SUMS]
    serial = ranks.run(1, serial_train_cases, [serial_case(case) for case in compared], timeout=300)[0]
    done.update({("serial", case): ref for case, ref in zip(compared, serial)})
    return done


def run_and_compare(trained, case):
    results, reference = list(trained[case]), trained["serial", case]
    full, tied_pairs = assemble(results)
    assert tied_pairs and all(torch.equal(a, b) for a, b, _, _ in tied_pairs), [
        (last, first, float((a - b).abs().max())) for a, b, last, first in tied_pairs]
    assert full.keys() == reference["params"].keys()
    assert reference["norms"][0] > CLIP  # clipping acts: the tied copy must count once in the norm
    for res in results:
        assert res["norms"] == pytest.approx(reference["norms"], rel=1e-5)
    worst = max((float((full[n] - reference["params"][n]).abs().max()), n) for n in full)
    assert worst[0] < 1e-6, worst


def test_tied_embedding_pp2_dp2_matches_single_process(trained):
    run_and_compare(trained, TIED)


def test_tied_embedding_pp2_virtual_stages_dp2_matches_single_process(trained):
    run_and_compare(trained, VIRTUAL)


def test_tp2_sequence_parallel_pp2_matches_single_process(trained):
    run_and_compare(trained, TP_SP)


def test_per_token_loss_pp2_dp2_matches_single_process(trained):
    run_and_compare(trained, PER_TOKEN)


def test_without_the_sums_the_tied_copies_drift_apart(trained):
    """What megatron_zero did before it kept finalize_model_grads' sums: the checks above can fail."""
    results = list(trained[NO_SUMS])  # ZeRO-1, one step
    _, tied_pairs = assemble(results)
    assert all(float((a - b).abs().max()) > 1e-3 for a, b, _, _ in tied_pairs)


class ReplicatedChunk(torch.nn.Module):
    """Four weights replicated on both TP ranks, each marked as Megatron marks them."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        torch.manual_seed(0)
        self.norm, self.q_layernorm, self.averaged, self.plain = (torch.nn.Linear(4, 4) for _ in range(4))
        for p in self.norm.parameters():
            p.sequence_parallel = True
        self.averaged.weight.average_gradients_across_tp_domain = True

    def forward(self, x):
        return sum(m(x).pow(2).sum() for m in (self.norm, self.q_layernorm, self.averaged, self.plain))


def tp_replicated_grads(stage):
    """TP 2: each rank's own gradients (its own tokens) and what the finalize function leaves."""
    import torch.distributed as dist
    from megatron.core.transformer import TransformerConfig

    from l3plugin.megatron.zero import finalize_grads_func, megatron_zero
    from l3plugin.mesh.groups import init_mesh

    init_mesh(tp=2)
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, tensor_model_parallel_size=2,
                               sequence_parallel=True, qk_layernorm=True, use_cpu_initialization=True)
    chunk = ReplicatedChunk(config)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(dist.get_rank()))
    own = dict(zip([n for n, _ in chunk.named_parameters()],
                   torch.autograd.grad(chunk(x), list(chunk.parameters()))))
    zero = megatron_zero([chunk], torch.optim.SGD(chunk.parameters(), lr=0.1), stage=stage)
    chunk(x).backward()
    zero.end_of_round(list(chunk.parameters()), True)
    finalize_grads_func(zero)([chunk], None)
    return {"own": own, "final": {n: zero.full_grad(p) for n, p in chunk.named_parameters()}}


@pytest.mark.parametrize("stage", [1, 2])
def test_tp_replicated_gradients_are_summed_averaged_or_kept_as_megatron_marks_them(ranks, stage):
    a, b = ranks.run(2, tp_replicated_grads, stage, timeout=120)
    for name in a["own"]:
        both = a["own"][name] + b["own"][name]
        summed = name.startswith(("norm.", "q_layernorm."))  # sequence_parallel; qk_layernorm by name
        averaged = name == "averaged.weight"
        if summed or averaged:
            expected = (both, both) if summed else (both / 2, both / 2)
        else:  # unmarked: each TP rank keeps its own (Megatron does not reduce it either)
            expected = (a["own"][name], b["own"][name])
        assert torch.allclose(a["final"][name], expected[0], atol=1e-6), name
        assert torch.allclose(b["final"][name], expected[1], atol=1e-6), name
        assert torch.equal(a["final"][name], b["final"][name]) == (summed or averaged), name


@pytest.mark.parametrize("name, value", [("num_moe_experts", 8), ("mtp_num_layers", 1), ("has_cond_embedder", True),
                                         ("gradient_accumulation_fusion", True),
                                         ("defer_embedding_wgrad_compute", True), ("gtp_weight_remat_size", 2)])
def test_configs_whose_finalize_work_is_not_carried_over_are_refused(name, value):
    from types import SimpleNamespace

    from l3plugin.megatron.zero import megatron_zero

    model = torch.nn.Linear(2, 2)
    model.config = SimpleNamespace(**{name: value})
    with pytest.raises(ValueError, match=rf"config\.{name}={value!r} is not supported .*unset {name}"):
        megatron_zero([model], torch.optim.SGD(model.parameters(), lr=0.1))


def test_per_token_loss_refuses_a_gradient_scale():
    from types import SimpleNamespace

    from l3plugin.megatron.zero import megatron_zero

    model = torch.nn.Linear(2, 2)
    model.config = SimpleNamespace(calculate_per_token_loss=True)
    with pytest.raises(ValueError, match=r"gradient_scale=0\.5 with config\.calculate_per_token_loss"):
        megatron_zero([model], torch.optim.SGD(model.parameters(), lr=0.1), gradient_scale=0.5)
