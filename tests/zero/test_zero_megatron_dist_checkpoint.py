"""FP32-reducing ZeRO state through megatron.core.dist_checkpointing (torch_dist): saved next to a Megatron
GPTModel's own sharded state dict by 2 data-parallel ranks, loaded back onto 4 and 1, bit for bit (and onto 2, with a
NaN put in what was loaded, refused)."""

import os

import pytest
import torch

TIMEOUT = 180


def _snapshot(zero):
    return {zero.param_names[p]: [zero.full_master(p)] + [zero.full_master(p, k) for k in ("exp_avg", "exp_avg_sq")]
            for p in zero.params}


def _setup():
    import torch.distributed as dist

    from l3plugin.megatron.zero import megatron_zero
    from l3plugin.mesh.groups import init_mesh
    from tiny_gpt import build_gpt, gpt_config

    init_mesh(dp=dist.get_world_size())
    model = build_gpt(gpt_config(num_layers=1, hidden=32))
    zero = megatron_zero([model], torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1), stage=2,
                         bucket_numel=3000)
    return model, zero


def _train(model, zero, steps, seed):
    import torch.distributed as dist

    from tiny_gpt import forward_step, microbatches

    data = iter(microbatches(2 * steps, 2, 16, seed=seed + dist.get_rank()))
    for _ in range(steps):
        for _ in range(2):
            out, loss_fn = forward_step(data, model)
            loss_fn(out)[0].backward()
        zero.step()


class _TorchDistSaveOnCpu:
    """TEST-ONLY, two things Megatron-Core 0.16.1's torch_dist *save* needs that the harness lacks:
    - it starts helper processes (a multiprocessing Manager, writers); Megatron-LM's ranks may, the harness'
      daemonic workers may not: the flag is lifted while saving;
    - filesystem_async.py:230 calls torch.cuda.synchronize() after its device-to-host copies and
      state_dict_saver.py:252 puts a flag on torch.cuda.current_device(): while saving, "the CUDA device" is
      the CPU (synchronize a no-op). Loading needs neither."""

    def __enter__(self):
        import multiprocessing

        self.config = multiprocessing.current_process()._config
        self.was = self.config.get("daemon")
        self.config["daemon"] = False
        self.sync, torch.cuda.synchronize = torch.cuda.synchronize, lambda *a, **k: None
        self.device, torch.cuda.current_device = torch.cuda.current_device, lambda: "cpu"

    def __exit__(self, *exc):
        self.config["daemon"] = self.was
        torch.cuda.synchronize, torch.cuda.current_device = self.sync, self.device


def save_leg(folder):
    from megatron.core import dist_checkpointing

    from l3plugin.checkpoint.megatron_dist import zero_sharded_state_dict

    model, zero = _setup()
    _train(model, zero, 2, seed=0)
    model_sd = model.sharded_state_dict()
    with _TorchDistSaveOnCpu():
        dist_checkpointing.save({"model": model_sd, "optimizer": zero_sharded_state_dict(zero, model_sd)}, folder)
    return {"snapshot": _snapshot(zero), "lr": zero.optimizer.param_groups[0]["lr"],
            "step": float(zero.optimizer.state[zero.buckets[0].master]["step"])}


def load_leg(folder):
    from megatron.core import dist_checkpointing

    from l3plugin.checkpoint.megatron_dist import load_zero_sharded_state_dict, zero_sharded_state_dict

    model, zero = _setup()
    model_sd = model.sharded_state_dict()
    loaded = dist_checkpointing.load({"optimizer": zero_sharded_state_dict(zero, model_sd, is_loading=True)}, folder)
    load_zero_sharded_state_dict(zero, loaded["optimizer"])
    snapshot = _snapshot(zero)  # one all-reduce per tensor: the full masters are read once
    out = {"snapshot": snapshot, "lr": zero.optimizer.param_groups[0]["lr"],
           "step": float(zero.optimizer.state[zero.buckets[0].master]["step"]),
           "params_are_masters": all(torch.equal(p.detach(), snapshot[zero.param_names[p]][0]) for p in zero.params),
           "buckets": len(zero.buckets)}
    _train(model, zero, 1, seed=100)
    out["step_after"] = float(zero.optimizer.state[zero.buckets[0].master]["step"])
    return out


@pytest.fixture(scope="module")
def saved_checkpoint(ranks, tmp_path_factory):
    """(folder, rank 0's save_leg result): one torch_dist checkpoint saved by 2 DP ranks, which the tests only
    read."""
    folder = str(tmp_path_factory.mktemp("dist") / "ckpt")
    os.makedirs(folder)
    return folder, ranks.run(2, save_leg, folder, timeout=TIMEOUT)[0]


def test_dist_checkpointing_round_trip_and_dp_resharding(ranks, saved_checkpoint):
    folder, saved = saved_checkpoint
    assert os.path.isfile(os.path.join(folder, "metadata.json"))  # a torch_dist checkpoint
    assert saved["step"] == 2.0
    # Onto 4 and 1 ranks (the reader copies each rank's ranges of the full tensors, whatever the DP size: the same
    # path at 2, where the NaN test loads).
    for world in (4, 1):
        for r in ranks.run(world, load_leg, folder, timeout=TIMEOUT):
            assert r["snapshot"].keys() == saved["snapshot"].keys()
            for name, tensors in saved["snapshot"].items():
                assert all(torch.equal(a, b) for a, b in zip(tensors, r["snapshot"][name])), (world, name)
            assert r["lr"] == saved["lr"] and r["step"] == 2.0 and r["step_after"] == 3.0
            assert r["params_are_masters"]


def nan_load_leg(folder, nan_on_rank):
    """A NaN in what dist_checkpointing returned on one rank: every rank refuses, nothing changes."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from l3plugin.checkpoint.megatron_dist import load_zero_sharded_state_dict, zero_sharded_state_dict

    model, zero = _setup()
    before = [b.master.detach().clone() for b in zero.buckets] + [p.detach().clone() for p in zero.params]
    model_sd = model.sharded_state_dict()
    loaded = dist_checkpointing.load({"optimizer": zero_sharded_state_dict(zero, model_sd, is_loading=True)}, folder)
    if dist.get_rank() == nan_on_rank:
        loaded["optimizer"]["param_state"][len(zero.params) - 1]["exp_avg"].view(-1)[-1] = float("nan")  # in its shard
    try:
        load_zero_sharded_state_dict(zero, loaded["optimizer"])
        error = None
    except Exception as exc:  # noqa: BLE001 - the message is what we check
        error = f"{type(exc).__name__}: {exc}"
    after = [b.master.detach() for b in zero.buckets] + [p.detach() for p in zero.params]
    return {"error": error, "unchanged": all(torch.equal(a, b) for a, b in zip(before, after))
            and not zero.optimizer.state}


def test_dist_checkpointing_nan_is_refused_on_every_rank(ranks, saved_checkpoint):
    folder, _ = saved_checkpoint  # the NaN is put in what was loaded, in memory: the checkpoint stays as saved
    legs = ranks.run(2, nan_load_leg, folder, 1, timeout=TIMEOUT)
    assert legs[1]["error"].startswith("ValueError: loaded optimizer state 'exp_avg'")
    assert "non-finite" in legs[1]["error"]
    assert legs[0]["error"].startswith("PeerFailed") and "rank 1: ValueError" in legs[0]["error"]
    assert legs[0]["unchanged"] and legs[1]["unchanged"]
