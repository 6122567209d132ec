"""Run under torchrun: routing replay under one layout; writes JSON (rank 0) for tests/routing/test_replay.py.

1. Record routes and log-probs at theta_old; replay them at theta_old (log-probs must be bitwise equal,
   in the scoring pass and in the training pass) and measure in-replay agreement (must be exactly 1).
2. Perturb every router so natural routing changes; record natural routes again (agreement < 1).
3. Replay the theta_old routes on the perturbed model: every router call is checked to route as
   replayed (the actor raises otherwise); the in-replay agreement must equal the offline agreement
   between the two recordings (proves the replay targets are aligned with the tokens).
4. Train one step under replay: routers get non-zero gradients; the consumption check passes.
5. Replay routes shifted by one position: agreement at theta_old drops and log-probs move.
"""

import argparse
import json

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    for name in ("tp", "pp", "ep"):
        parser.add_argument(f"--{name}", type=int, default=1)
    parser.add_argument("--recompute", default="none")
    parser.add_argument("--second-model", type=int, default=0)
    args = parser.parse_args()

    from megatron_rl.megatron_backend.actor.batch import TokenBatch
    from megatron_rl.megatron_backend.actor.megatron_actor import MegatronActor, OptimizerOptions
    from megatron_rl.megatron_backend.actor.model_builder import ModelOptions
    from megatron_rl.megatron_backend.actor.route_pass import RoutePass
    from megatron_rl.megatron_backend.distributed import init_distributed, shutdown
    from megatron_rl.parallel_layout import ParallelLayout
    from megatron_rl.routing.agreement import route_agreement
    from megatron_rl.routing.replay import ReplayChecks, RouteReplayError

    layout = ParallelLayout(tp=args.tp, pp=args.pp, ep=args.ep)
    init_distributed(layout, seed=7)
    options = ModelOptions(dispatcher="alltoall", recompute=args.recompute)
    actor = MegatronActor.from_hf(
        args.model,
        layout,
        model_options=options,
        optimizer_options=OptimizerOptions(lr=1e-3, clip_grad=0.0, distributed_optimizer=False),
        micro_batch_tokens=40,
    )
    gen = torch.Generator().manual_seed(5)
    b, s = 6, 20
    ids = torch.randint(4, 100, (b, s), generator=gen)
    lengths = torch.randint(14, s + 1, (b,), generator=gen)  # 2 micro-batches per DP rank at EP=2
    for i in range(b):
        ids[i, lengths[i] :] = 3
    batch = TokenBatch(ids, lengths, torch.full((b,), 4))
    valid = torch.arange(s).unsqueeze(0) < (lengths.unsqueeze(1) - 1)
    out: dict = {}

    second = None
    if args.second_model:  # a second model in the same process must not disturb the first one's replay
        second = MegatronActor.from_hf(args.model, layout, model_options=options, micro_batch_tokens=40)

    rec = actor.compute_log_probs(batch, route_mode="record")
    batch.routes = rec.routes
    rep = actor.compute_log_probs(batch, route_mode="replay")
    out["replay_theta_old_max_diff"] = float((rep.log_probs - rec.log_probs).abs().max())
    first_replay = rep.log_probs
    out["agreement_theta_old"] = rep.agreement.agreement
    bare = actor.compute_log_probs(batch, route_mode="replay", replay=ReplayChecks(check=False, agreement=False))
    out["unchecked_replay_bitwise"] = torch.equal(bare.log_probs, rep.log_probs) and bare.agreement is None
    if second is not None:
        rep2 = second.compute_log_probs(batch, route_mode="replay")
        out["second_model_max_diff"] = float((rep2.log_probs - rec.log_probs).abs().max())
        rep = actor.compute_log_probs(batch, route_mode="replay")
        out["first_after_second_bitwise"] = torch.equal(rep.log_probs, first_replay)

    # Training pass at theta_old: the log-probs the loss sees must equal the recording pass bitwise.
    batch.fields["old_log_probs"] = rec.log_probs
    seen: dict = {"max_diff": 0.0}
    router_grads: list[float] = []

    def loss_fn(logp, ent, mb):
        mask = (torch.arange(logp.shape[1]).unsqueeze(0) < mb.lengths.unsqueeze(1)).to(logp.device)
        mask[:, 0] = False
        if mb.padding_rows:
            mask[-mb.padding_rows :] = False
        diff = ((logp.detach() - mb.fields["old_log_probs"].to(logp.device)).abs() * mask).max()
        seen["max_diff"] = max(seen["max_diff"], float(diff))
        count = mask.sum().to(torch.int)
        return -(logp * mask).sum(), count, {}

    actor.warmup_step(batch, loss_fn, lr=0.0, route_mode="replay")  # theta stays theta_old
    out["train_theta_old_max_logp_diff"] = seen["max_diff"]
    seen["max_diff"] = 0.0

    # Perturb every router so that natural routing changes, then keep the old routes in the batch.
    with torch.no_grad():
        g = torch.Generator().manual_seed(11)
        for h in actor.routers.handles:
            w = h.router.weight
            w.add_(torch.randn(w.shape, generator=g) * w.std())
    actor.reload_main_params()
    nat = actor.compute_log_probs(batch, route_mode="record")
    out["offline_agreement_after_perturb"] = route_agreement(rec.routes, nat.routes, valid).agreement
    offline = route_agreement(rec.routes, nat.routes, valid)
    out["offline_token_all_agree_after_perturb"] = offline.token_all_layers_agree
    out["offline_per_layer_after_perturb"] = offline.per_layer
    rep = actor.compute_log_probs(batch, route_mode="replay")
    out["replay_agreement_after_perturb"] = rep.agreement.agreement
    out["replay_token_all_agree_after_perturb"] = rep.agreement.token_all_layers_agree
    out["replay_per_layer_after_perturb"] = rep.agreement.per_layer
    # Natural routing changed the log-probs; replay brings back different ones than natural routing.
    out["replay_differs_from_natural"] = not torch.equal(rep.log_probs, nat.log_probs)

    # Training-pass log-probs equal a replayed scoring pass of the same weights (bitwise).
    batch.fields["old_log_probs"] = rep.log_probs

    def grab_grads(*_):
        for h in actor.routers.handles:
            grad = getattr(h.router.weight, "main_grad", None)
            grad = h.router.weight.grad if grad is None else grad
            router_grads.append(float(grad.norm()))

    # The optimizer's clip and step come right after the schedule and the grad norm; read the grads before them.
    from megatron_rl.megatron_backend.actor import training_setup

    step_fn = training_setup.clip_and_step

    def step_with_probe(optimizer, grad_norm):
        grab_grads()
        return step_fn(optimizer, grad_norm)

    training_setup.clip_and_step = step_with_probe
    metrics = actor.train_step(batch, loss_fn, route_mode="replay")
    training_setup.clip_and_step = step_fn
    out["train_max_logp_diff"] = seen["max_diff"]
    out["train_metrics"] = {k: v for k, v in metrics.items() if k.startswith("routing/")}
    out["router_grad_norms"] = router_grads

    # Consumption check: a router that runs with no target set for it must be caught.
    try:
        bad = TokenBatch(ids, lengths, torch.full((b,), 4), routes=rec.routes)
        orig = RoutePass._set_replay_targets

        def skip_first(self, mb, chunk, calls=[0]):  # noqa: B006 - counter
            calls[0] += 1
            valid_ = orig(self, mb, chunk)
            if calls[0] == 1:
                for h in actor.routers.handles:
                    h.router.router_replay.replay_backward_list.append(h.router.router_replay.target_topk_idx)
            return valid_

        RoutePass._set_replay_targets = skip_first
        actor.compute_log_probs(bad, route_mode="replay")
        out["extra_route_caught"] = False
    except RouteReplayError as e:
        out["extra_route_caught"] = "not consumed exactly once" in str(e)
    finally:
        RoutePass._set_replay_targets = orig

    # Off-by-one: routes shifted by one position (as an R3 layout slip would do), against aligned ones.
    now = actor.compute_log_probs(batch, route_mode="record")
    batch.routes = now.routes
    aligned = actor.compute_log_probs(batch, route_mode="replay")
    out["aligned_agreement"] = aligned.agreement.agreement
    shifted = now.routes.clone()
    shifted[:, :-1] = now.routes[:, 1:]
    batch.routes = shifted
    moved = actor.compute_log_probs(batch, route_mode="replay")
    out["shifted_agreement"] = moved.agreement.agreement
    out["shifted_logp_max_diff"] = float((moved.log_probs - now.log_probs).abs().max())

    if torch.distributed.get_rank() == 0:
        json.dump(out, open(args.out, "w"), indent=1)
    shutdown()


if __name__ == "__main__":
    main()
