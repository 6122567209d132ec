"""Harness for Megatron tests: a torchrun launcher and a tiny, layout-independent MoE GPT.

`run_torchrun` starts a script under `python -m torch.distributed.run` on a free port and
fails with the workers' full output. Scripts write their numbers as JSON to a path given in
their arguments, so tests assert on values rather than on log text.

`TinyMoE` builds the same tiny model under any `ParallelLayout`, with weights that do not
depend on the layout (`init_layout_independent_`), and trains it with Megatron's DDP,
optimizer and pipeline schedules (`train`). Scripts under tests/scripts import this
module; Megatron is imported lazily so the launcher stays cheap to import.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from megatron_rl.megatron_backend.distributed import free_port

REPO_ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent / "scripts"


# --------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------


class TorchrunError(RuntimeError):
    """A torchrun job failed or timed out; the message holds its full stdout and stderr."""


def _as_text(data: bytes | str | None) -> str:
    if data is None:
        return ""
    return data.decode(errors="replace") if isinstance(data, bytes) else data


def _kill_tree(proc: subprocess.Popen) -> None:
    """Stop a torchrun launcher and its workers (which torchrun puts in sessions of their own)."""
    import psutil

    try:
        workers = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        workers = []
    proc.send_signal(signal.SIGTERM)  # torchrun forwards it to the workers
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
    for worker in workers:
        with contextlib.suppress(psutil.NoSuchProcess):
            worker.kill()


def run_torchrun(script: Path, nproc: int, args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `script` on `nproc` local ranks with torch.distributed.run; raise on failure.

    Each rank gets OMP_NUM_THREADS=1 and the repository on PYTHONPATH. The rendezvous is
    static on 127.0.0.1 and a random free port (retried once if another process took the
    port in between). On a non-zero exit, or after `timeout` seconds (then the launcher and
    all its workers are killed), TorchrunError carries the command, stdout and stderr.
    """
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env.pop("RANK", None)
    for attempt in range(2):
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            "--nproc_per_node", str(nproc),
            "--master_addr", "127.0.0.1",
            "--master_port", str(free_port()),
            str(script), *args,
        ]  # fmt: skip
        # Output goes to files, not pipes: a worker that dies abruptly can leave grandchildren (e.g. the
        # checkpoint writer's multiprocessing helpers) that would hold a pipe open forever.
        with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
            proc = subprocess.Popen(
                cmd, cwd=REPO_ROOT, env=env, stdout=out, stderr=err, text=True, start_new_session=True
            )
            try:
                proc.wait(timeout=timeout)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
            _kill_tree(proc)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)  # leftovers in torchrun's session
            out.seek(0)
            err.seek(0)
            stdout, stderr = out.read(), err.read()
        if timed_out:
            raise TorchrunError(
                f"timed out after {timeout:.0f}s: {' '.join(cmd)}\n--- stdout ---\n{stdout}\n--- stderr ---\n{stderr}"
            )
        result = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
        if result.returncode == 0:
            return result
        if attempt == 0 and "address already in use" in (stderr + stdout).lower():
            continue
        raise TorchrunError(
            f"exit code {result.returncode}: {' '.join(cmd)}\n--- stdout ---\n{stdout}\n--- stderr ---\n{stderr}"
        )
    raise AssertionError("unreachable")


# --------------------------------------------------------------------------------------
# Tiny MoE GPT, identical under every layout
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TinyMoE:
    """A tiny MoE GPT on Megatron's local (non-TE) layer spec, and how to train it."""

    num_layers: int = field(default=2, metadata={"help": "transformer layers"})
    hidden_size: int = field(default=64, metadata={"help": "model width"})
    num_attention_heads: int = field(default=4, metadata={"help": "attention heads"})
    ffn_hidden_size: int = field(default=128, metadata={"help": "expert MLP width"})
    num_experts: int = field(default=4, metadata={"help": "experts per MoE layer"})
    topk: int = field(default=2, metadata={"help": "experts per token"})
    vocab_size: int = field(default=128, metadata={"help": "vocabulary size"})
    seq_length: int = field(default=32, metadata={"help": "tokens per sequence"})
    dispatcher: str = field(default="alltoall", metadata={"help": "MoE token dispatcher"})
    global_batch: int = field(default=8, metadata={"help": "sequences per optimizer step, all ranks"})
    micro_batch: int = field(default=2, metadata={"help": "sequences per micro-batch"})
    lr: float = field(default=3e-3, metadata={"help": "Adam learning rate"})
    init_std: float = field(default=0.02, metadata={"help": "std of the layout-independent weight init"})

    def config(self, layout: Any) -> Any:
        """The TransformerConfig for `layout` (a ParallelLayout)."""
        from megatron.core.transformer import TransformerConfig

        return TransformerConfig(
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            ffn_hidden_size=self.ffn_hidden_size,
            num_moe_experts=self.num_experts,
            moe_router_topk=self.topk,
            moe_token_dispatcher_type=self.dispatcher,
            add_bias_linear=False,  # SequentialMLP + bias: in-place-on-view autograd error
            hidden_dropout=0.0,  # dropout RNG streams differ per TP rank: no layout parity
            attention_dropout=0.0,
            use_cpu_initialization=True,
            params_dtype=torch.float32,
            **layout.to_model_parallel_config_kwargs(pipeline_dtype=torch.float32),
        )

    def build(self, layout: Any) -> tuple[list[torch.nn.Module], Any]:
        """Model chunks of this rank (one per virtual stage) and their config.

        parallel_state must be initialised with `layout`.
        """
        from megatron.core import parallel_state as ps
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        config = self.config(layout)
        spec = get_gpt_layer_local_spec(num_experts=self.num_experts, moe_grouped_gemm=False)
        chunks = []
        for stage in range(layout.vpp or 1):
            vp_stage = stage if layout.vpp else None
            chunks.append(
                GPTModel(
                    config=config,
                    transformer_layer_spec=spec,
                    vocab_size=self.vocab_size,
                    max_sequence_length=self.seq_length,
                    pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                    post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                    vp_stage=vp_stage,
                )
            )
        return chunks, config

    def token_batches(self, steps: int, seed: int) -> torch.Tensor:
        """Token ids [steps, global_batch, seq_length + 1]: one fixed random batch, repeated.

        Training on the same batch makes the loss fall step after step, a cheap sign that
        gradients and the optimizer work; the batch is identical on every rank.
        """
        gen = torch.Generator().manual_seed(seed)
        batch = torch.randint(0, self.vocab_size, (self.global_batch, self.seq_length + 1), generator=gen)
        return batch.expand(steps, -1, -1).clone()


SMOKE_MODEL = TinyMoE(num_layers=4)
"""The model of the layout smoke test: 4 layers so that pp=2 x vpp=2 holds one layer per chunk."""


def init_layout_independent_(chunks: list[torch.nn.Module], seed: int, std: float = 0.02) -> int:
    """Overwrite every matrix parameter with values that depend only on its global name.

    Megatron's `use_cpu_initialization` builds each TP-sharded weight from a full master
    weight and splits it, so TP layouts agree; but the CPU generator is consumed in
    module-construction order, and a rank holds only its own pipeline stage / experts, so
    PP and EP ranks draw different numbers than one process does. Here each global tensor
    (key and global shape from `sharded_state_dict()`, the same for every layout) is drawn
    from a generator seeded by (seed, crc32(key)), and each rank copies its slice. Vectors
    (norm weights) keep their constant init. Returns the number of tensors written.
    """
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

    written = 0
    with torch.no_grad():
        for chunk in chunks:
            sharded, _ = extract_sharded_tensors_and_factories(chunk.sharded_state_dict())
            for sh in _flat_sharded(sharded):
                written += _write_slice(sh, seed, std, ShardedTensor)
    return written


def _write_slice(sh: Any, seed: int, std: float, sharded_tensor_type: type) -> int:
    if not isinstance(sh, sharded_tensor_type):
        raise TypeError(f"{sh.key}: {type(sh).__name__} is not handled (e.g. a GLU fc1 factory)")
    if sh.data is None or sh.data.dim() < 2 or not sh.data.is_floating_point():
        return 0
    if sh.flattened_range is not None:
        raise TypeError(f"{sh.key}: flattened ShardedTensor is not handled")
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(sh.key.encode()))
    full = torch.randn(sh.global_shape, generator=gen) * std
    sh.data.copy_(full[sh.global_slice()].reshape(sh.data.shape))
    return 1


def _flat_sharded(state: Any) -> Iterator[Any]:
    if isinstance(state, dict):
        for value in state.values():
            yield from _flat_sharded(value)
    elif isinstance(state, (list, tuple)):
        for value in state:
            yield from _flat_sharded(value)
    else:
        yield state


@dataclass
class Trainer:
    """Megatron DDP + optimizer + forward/backward schedule around model chunks."""

    chunks: list[torch.nn.Module]
    optimizer: Any
    config: Any
    model: TinyMoE


def make_trainer(
    model: TinyMoE, layout: Any, *, seed: int, distributed_optimizer: bool = False, layout_independent_init: bool = True
) -> Trainer:
    """Build `model` under `layout`, wrapped for training.

    With `layout_independent_init` (the default) weights come from `init_layout_independent_`;
    without it they are Megatron's own CPU initialisation (which differs under PP and EP).
    """
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    chunks, config = model.build(layout)
    if layout_independent_init:
        init_layout_independent_(chunks, seed, model.init_std)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=distributed_optimizer
    )
    wrapped = [
        DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk, disable_bucketing=i > 0)
        for i, chunk in enumerate(chunks)
    ]
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=model.lr,
            clip_grad=1.0,
            use_distributed_optimizer=distributed_optimizer,
            params_dtype=torch.float32,
        ),
        wrapped,
    )
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    config.no_sync_func = [m.no_sync for m in wrapped] if len(wrapped) > 1 else wrapped[0].no_sync
    return Trainer(chunks=wrapped, optimizer=optimizer, config=config, model=model)


def _forward_step(seq_length: int, data_iterator: Iterator, model: torch.nn.Module) -> tuple:
    tokens, labels = next(data_iterator)
    position_ids = torch.arange(seq_length).unsqueeze(0).expand_as(tokens)
    output = model(tokens, position_ids, attention_mask=None, labels=labels)

    def loss_func(per_token_loss: torch.Tensor) -> tuple[torch.Tensor, dict]:
        loss = per_token_loss.float().mean()
        return loss, {"loss": loss.detach().clone()}

    return output, loss_func


def train(trainer: Trainer, tokens: torch.Tensor) -> dict[str, list[float]]:
    """One optimizer step per tokens[i] ([global_batch, seq+1]); returns loss and grad norm per step.

    The global batch is split over data-parallel ranks, then into micro-batches. The
    reported loss is the mean over all micro-batches of all data-parallel ranks (what a
    single process computes), the grad norm is the one the optimizer clipped with.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    model = trainer.model
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    per_rank = model.global_batch // dp
    num_micro = per_rank // model.micro_batch
    losses: list[float] = []
    grad_norms: list[float] = []
    for step_tokens in tokens:
        local = step_tokens[dp_rank * per_rank : (dp_rank + 1) * per_rank]
        micro = [
            (local[i : i + model.micro_batch, :-1], local[i : i + model.micro_batch, 1:])
            for i in range(0, per_rank, model.micro_batch)
        ]
        iterators = [iter(micro) for _ in trainer.chunks]
        for chunk in trainer.chunks:
            chunk.zero_grad_buffer()
        trainer.optimizer.zero_grad()
        reduced = get_forward_backward_func()(
            forward_step_func=partial(_forward_step, model.seq_length),
            data_iterator=iterators if len(iterators) > 1 else iterators[0],
            model=trainer.chunks,
            num_microbatches=num_micro,
            seq_length=model.seq_length,
            micro_batch_size=model.micro_batch,
            forward_only=False,
        )
        ok, grad_norm, _ = trainer.optimizer.step()
        if not ok:
            raise RuntimeError("optimizer step was skipped")
        # Only last-stage ranks hold losses; TP replicas count twice in both sums, which cancels.
        stats = torch.tensor([sum(float(r["loss"]) for r in reduced), float(len(reduced))], dtype=torch.float64)
        torch.distributed.all_reduce(stats)
        losses.append(float(stats[0] / stats[1]))
        grad_norms.append(float(grad_norm))
    return {"loss": losses, "grad_norm": grad_norms}
