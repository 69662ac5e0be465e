"""benchmarks/zero.py and its DeepSpeed peer (benchmarks/_deepspeed.py): how DeepSpeed is configured, how
the table's ratios and memory columns are formed, and that a run refuses to time variants whose losses
differ from DDP's. Only the last test needs DeepSpeed (the ``bench`` extra); it is skipped where it is absent."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))
import _deepspeed  # noqa: E402
import zero  # noqa: E402


def test_deepspeed_config_matches_tessera_settings():
    numel = 1000
    for stage in (1, 2, 3):
        cfg = _deepspeed.ds_config(stage, offload=False, micro_batch=4, numel=numel)
        z = cfg["zero_optimization"]
        assert z["stage"] == stage and z["reduce_bucket_size"] == numel  # capped at the model's size
        assert ("allgather_bucket_size" in z) == (stage < 3)
        assert "offload_optimizer" not in z and "offload_param" not in z
        assert cfg["gradient_clipping"] == 1.0 and cfg["train_micro_batch_size_per_gpu"] == 4
        assert not cfg["fp16"]["enabled"] and not cfg["bf16"]["enabled"]
        assert cfg["zero_force_ds_cpu_optimizer"] is False  # torch AdamW also under offload
    big = _deepspeed.ds_config(2, offload=False, micro_batch=1, numel=10**9)["zero_optimization"]
    assert big["reduce_bucket_size"] == big["allgather_bucket_size"] == 25 * 2**20 // 4  # tessera's 25 MiB
    off = _deepspeed.ds_config(3, offload=True, micro_batch=1, numel=numel)["zero_optimization"]
    assert off["offload_optimizer"]["device"] == off["offload_param"]["device"] == "cpu"
    assert "offload_param" not in _deepspeed.ds_config(2, True, 1, numel)["zero_optimization"]
    # the like-for-like ZeRO-3 peers shard every parameter; ds3_default keeps DeepSpeed's threshold
    assert "stage3_param_persistence_threshold" not in off
    shard_all = _deepspeed.ds_config(3, False, 1, numel, persistence=0)["zero_optimization"]
    assert shard_all["stage3_param_persistence_threshold"] == 0
    assert "stage3_param_persistence_threshold" not in _deepspeed.ds_config(2, False, 1, numel, 0)["zero_optimization"]
    assert zero.DS_SHARD_ALL == ("ds3", "ds3_offload") and "ds3_default" in zero.VARIANTS


def test_each_variant_runs_next_to_its_deepspeed_peer():
    """Every variant runs once a round, and each tessera variant right before its DeepSpeed peer, so a
    round's ratio divides steps taken seconds apart."""
    assert sorted(zero.RUN_ORDER) == sorted(zero.VARIANTS)
    pos = {k: i for i, k in enumerate(zero.RUN_ORDER)}
    assert all(pos[peer] == pos[k] + 1 for k, peer in zero.DS_PEER.items() if k.startswith("zero"))
    assert all(abs(pos[peer] - pos[k]) <= 2 for k, peer in zero.FSDP_PEER.items())


def _results(scale: dict[str, float], rounds: int = 3) -> list[dict]:
    """Two ranks' timings: variant k takes scale[k] × (1 + round) s on rank 0 and half that on rank 1;
    rank 1 holds more model state."""
    def rank(r):
        return {"times": {k: [[scale[k] * (1 + i) / (r + 1)] * 3 for i in range(rounds)] for k in zero.VARIANTS},
                "state": {k: 2**20 * (r + 1) * scale[k] for k in zero.VARIANTS}}
    return [rank(0), rank(1)]


def test_summary_ratios_are_per_round_against_the_same_stage_peer():
    scale = {k: 1.0 for k in zero.VARIANTS} | {"zero3": 0.5, "ds3": 2.0, "zero1": 3.0, "fsdp2_offload": 4.0}
    s = zero.summarize(_results(scale))
    assert s["zero3"]["vs_ds"] == pytest.approx([0.25] * 3)  # zero3 ↔ ds3, the slowest rank's time per round
    assert s["zero1"]["vs_ds"] == pytest.approx([3.0] * 3)  # zero1 ↔ ds1
    assert s["zero3_offload"]["vs_fsdp2"] == pytest.approx([0.25] * 3)  # offload ↔ FSDP2 offload
    assert s["ds3"]["vs_fsdp2"] == pytest.approx([2.0] * 3) and s["ds3"]["vs_ds"] is None
    assert s["zero1"]["vs_fsdp2"] is None and s["fsdp2"]["vs_fsdp2"] is None  # FSDP2 is ZeRO-3 only
    assert s["ddp"]["vs_ds"] is None and s["zero3"]["step"] == pytest.approx(0.5 * 2)  # median of 0.5, 1, 1.5
    assert s["zero3"]["state"] == 2 * 2**20 * 0.5  # the largest rank

    rows = zero.rows_for(2, s, {k: 2**20 for k in zero.VARIANTS})
    by_kind = {row.split(" | ")[1]: row.split(" | ") for row in rows}
    assert by_kind["zero3"][3] == "0.250 (0.250–0.250)" and by_kind["zero3"][7] == "0.250"  # memory ÷ ds3
    assert by_kind["ds1"][3] == "—" and by_kind["ds1"][7] == "—"
    assert by_kind["zero3"][4] == "0.500 (0.500–0.500)" and by_kind["ds3"][4] == "2.000 (2.000–2.000)"
    assert all(by_kind[k][4] == "—" for k in ("ddp", "zero1", "zero2", "fsdp2", "fsdp2_offload", "ds1", "ds2"))
    assert len(rows) == len(zero.VARIANTS)


def test_doc_block_states_provenance_target_and_every_column(tmp_path, monkeypatch):
    import argparse

    monkeypatch.setattr(zero, "DOC", tmp_path / "BENCHMARKS.md")
    monkeypatch.setattr(sys, "argv", ["benchmarks/zero.py", "--ranks", "2"])
    s = zero.summarize(_results({k: 1.0 for k in zero.VARIANTS}))
    rows = zero.rows_for(2, s, {k: 2**20 for k in zero.VARIANTS})
    args = argparse.Namespace(preset="small", batch=8, seq=128, rounds=7, steps=3, warmup=1)
    zero.write_doc(rows, args, 3_000_000, "NOTE.")
    text = (tmp_path / "BENCHMARKS.md").read_text()
    block = text.split("<!-- zero:begin -->\n", 1)[1]
    assert block.startswith("Command: `python benchmarks/zero.py --ranks 2`; commit ")
    assert ("Target: tessera ÷ DeepSpeed ≤ 1.00 at the same ZeRO stage, and on the ZeRO-3 rows tessera ÷ FSDP2 "
            "≤ 1.00, each at equal or lower model-state bytes.") in block
    assert "÷ FSDP2 is given for the ZeRO-3 rows only" in block and "reduced slice" in block  # stage 1 on both sides
    assert "| ranks | variant | step (s) | ÷ DeepSpeed | ÷ FSDP2 | ÷ DDP |" in block and "NOTE." in block
    assert all(row in block for row in rows)


class _Fake:
    def __init__(self, kind, losses, grad_norm=1.5):
        self.kind, self._losses, self.loss, self.grad_norm = kind, iter(losses), None, grad_norm

    def step(self, x, y):
        self.loss = next(self._losses)
        return 0.0


def test_unlike_losses_stop_the_run():
    alike = [_Fake("ddp", [5.0, 4.0]), _Fake("ds3", [5.0 * (1 + 1e-7), 4.0 * (1 + 2e-6)])]
    losses = zero.check_losses(alike, None, None)
    assert losses["ds3"] == [5.0 * (1 + 1e-7), 4.0 * (1 + 2e-6)]
    note = zero.loss_note({2: [{"losses": losses}]})
    assert "largest difference after one update was 2.0e-06" in note and "alike" not in note
    with pytest.raises(zero.UnlikeRuns, match="first-batch.*ds3"):
        zero.check_losses([_Fake("ddp", [5.0, 4.0]), _Fake("ds3", [5.01, 4.0])], None, None)
    # same first loss, but the update moved it differently: a different optimizer, refused too
    with pytest.raises(zero.UnlikeRuns, match="after-one-update.*zero1"):
        zero.check_losses([_Fake("ddp", [5.0, 4.0]), _Fake("zero1", [5.0, 4.0 * (1 + 5e-4)])], None, None)
    # same losses, but a gradient twice DDP's (summed, not averaged): AdamW's first step hides it, the norm not
    with pytest.raises(zero.UnlikeRuns, match="gradient norms.*zero1"):
        zero.check_losses([_Fake("ddp", [5.0, 4.0]), _Fake("zero1", [5.0, 4.0], grad_norm=3.0)], None, None)


def ds_matches_tessera(rank, world_size):
    """tiny preset, 2 steps: DeepSpeed ZeRO-3 (every parameter sharded, and at its default persistence
    threshold) and tessera ZeRO-3 have the same losses, and DeepSpeed's model state as zero.py counts it."""
    from tessera.topology import ParallelConfig, Topology

    topo = Topology.build(ParallelConfig(dp_replicate=1, dp_shard=world_size))
    try:
        x, y = zero.token_batch(rank, 2, 16)
        out = {}
        for kind in ("zero3", "ds3", "ds3_default"):
            v = zero.Variant(kind, "tiny", topo, micro_batch=2)
            out[kind] = [(v.step(x, y), v.loss)[1] for _ in range(2)]
            out[kind + "_state"] = v.measure_state(x, y)
        numel = sum(p.numel() for p in zero.Transformer(zero.model_config("tiny")).parameters())
        return out, numel
    finally:
        topo.destroy()


def test_deepspeed_zero3_trains_like_tessera_zero3():
    pytest.importorskip("deepspeed")
    _deepspeed.build_ops()  # here, not in two ranks at once
    with zero.pool_manager() as pools:  # fresh processes: DeepSpeed's globals stay out of the shared pool
        results = pools.run(ds_matches_tessera, 2, timeout=300.0)
    for out, numel in results:
        assert out["ds3"] == pytest.approx(out["zero3"], rel=1e-5)
        assert out["ds3_default"] == pytest.approx(out["zero3"], rel=1e-5)
        # tiny's parameters are all below DeepSpeed's default persistence threshold (1e5), so each rank
        # holds, in fp32: every parameter whole (Ψ) and its partition (Ψ/2), the gradient partition and the
        # master (Ψ/2 each), both Adam moments (Ψ) and the reduce bucket (Ψ, capped at the model) = 4.5Ψ;
        # without the moments or the bucket the count would be 3.5Ψ
        assert out["ds3_default_state"] >= 4 * (4 * numel)
        # sharding every parameter drops the whole copies (Ψ) again
        assert out["ds3_state"] <= out["ds3_default_state"] - 0.9 * 4 * numel
