"""The training step: a causal LM, AdamW, the clipped policy loss on packed trees; weight export and checkpoints.

One Learner per process (rank). With world_size > 1 every rank builds its own Learner with the same config, and
each call (compute_logprobs, train_step, export_weights, save/load_checkpoint) must be made on all ranks together,
each with its own share of the trees (batch.py: shard_trees): FSDP2 gathers parameters inside every forward and
backward (and DeepSpeed reduces gradients inside backward), so the ranks agree on how many micro-batches to run (a
rank with fewer runs zero-weighted dummy passes). With world_size == 1 the model is trained as is, whatever the
strategy. Where FSDP2, DeepSpeed and one process differ is strategy.py; how a checkpoint is written and read,
checkpoint.py; how trees become forward passes and per-token loss weights, packing.py; the attention over packed
trees, tree_attention.py; log-probs without full-vocabulary logits, logprobs.py.

LoRA (LearnerConfig.lora_rank > 0): peft's LoRA layers are injected into the HF model in place (_add_adapters), so
the model is still the HF model that tree attention, the log-prob head and FSDP2's per-layer sharding expect; only
the adapters require gradients and sit in the optimizer. Exports (export_weights, export.py's export_packed for the
engines) are the merged weights under the base model's names; checkpoints hold the adapter (checkpoint.py).

One step (train_step): the trees' old log-probs are recomputed first when the PPO ratio needs them at the
current weights and the training pass cannot give them itself (learner.off_policy; LearnerConfig.recompute_pass),
then ppo_epochs x mini_batches optimizer steps, each accumulating micro-batches whose loss terms are already
normalised by the whole mini-batch's denominators (summed over ranks), so micro-batching, packing and sharding
leave the gradient unchanged.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoTokenizer, PreTrainedModel

from treepo_ray.algo.losses import TREE_FIGURES, tree_policy_loss
from treepo_ray.learner import packing
from treepo_ray.learner.batch import TrainSample, TrainTree, as_trees
from treepo_ray.learner.checkpoint import read_checkpoint, write_checkpoint
from treepo_ray.learner.config import LearnerConfig
from treepo_ray.learner.export import lora_layers, merged_state_dict, peft_lora_config
from treepo_ray.learner.schedule import lr_at, set_lr
from treepo_ray.learner.logprobs import LogprobHead, install_logprob_head
from treepo_ray.learner.strategy import make_strategy
from treepo_ray.learner.tree_attention import register as register_tree_attention

# Figures that are loss terms (already normalised sums), and token means (count-weighted, divided by "count").
LOSS_FIGURES = ("loss", "pg_loss", "kl_loss", "entropy")
TOKEN_FIGURES = ("pg_clipfrac", "pg_clipfrac_below", "pg_clipfrac_above", "pg_clipfrac_lower", "ppo_kl")
# Off-policy figures, when the trees carry behaviour log-probs (token means, is_weight_max the largest): the
# learner's log-probs at the step's start (proximal) against the engines' (behaviour): is_weight_mean/_max of
# pi_prox / pi_behav, is_weight_capped the share above learner.behaviour_cap, rollout_kl a k3 estimate of
# KL(behaviour || learner), the rollout/learner gap.

NodeValues = list[list[np.ndarray]]
"""Per tree, per node: one value per token (log-probs)."""


def prepare_model(model: PreTrainedModel, logprob_chunk: int, vocab_size: int | None = None) -> PreTrainedModel:
    """Make an HF causal LM the learner's: tree attention when given a layout (SDPA otherwise) and an output
    layer that returns log-probs and entropy chunk by chunk (logprobs.py), over the first `vocab_size` ids (the
    tokenizer's, as the engines sample; None = all)."""
    model.set_attn_implementation(register_tree_attention())
    install_logprob_head(model, logprob_chunk, vocab_size)
    model.config.use_cache = False
    return model


def micro_batch_logprobs(module: torch.nn.Module, model: PreTrainedModel, mb: packing.MicroBatch,
                         temperature: float = 1.0, entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob and entropy (zeros unless `entropy`) of every scored token of `mb` ([N] each, float32) at
    `temperature`. `module` is what runs the forward (the model, or a DeepSpeed engine around it), `model` the
    prepared HF model inside it."""
    head: LogprobHead = model.get_output_embeddings()
    with head.targets(mb.targets, temperature, entropy):
        if mb.layout is not None:
            # A ready 4D mask stops transformers from building a [T, T] one (every model family passes it through
            # as is); the tree attention ignores it: the layout says who attends to whom.
            placeholder = mb.input_ids.new_ones((1, 1, 1, 1), dtype=torch.bool)
            out = module(input_ids=mb.input_ids, position_ids=mb.position_ids, attention_mask=placeholder,
                         logits_to_keep=mb.keep, tree_layout=mb.layout, use_cache=False).logits[0]
        else:
            out = module(input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids,
                         use_cache=False).logits
            out = out.reshape(-1, 2).index_select(0, mb.select)
    return out[:, 0], out[:, 1]


class Learner:
    """Trains a Hugging Face causal LM with the clipped policy loss; one instance per rank."""

    def __init__(
        self,
        model_path: str | Path,
        cfg: LearnerConfig | None = None,
        rank: int = 0,
        world_size: int = 1,
        master_addr: str | None = None,
        master_port: int | str | None = None,
    ) -> None:
        self.cfg = cfg = cfg if cfg is not None else LearnerConfig()
        self.strategy = make_strategy(cfg, rank, world_size, master_addr, master_port)
        self.model_path, self.rank, self.world_size = Path(model_path), rank, world_size
        self.device = self.strategy.device
        torch.manual_seed(cfg.seed + rank)
        try:  # saved with each checkpoint (rank 0) so it is a complete HF model directory
            tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        except (OSError, ValueError):
            tokenizer = None
        self.tokenizer = tokenizer if rank == 0 else None
        # Log-probs over the tokenizer's ids, as the engines sample them (rows of a padded embedding excluded).
        self._tokenizer_vocab = len(tokenizer) if tokenizer is not None else None

        self.model = self._load_model(trainable=True)
        self.ref_model = self._load_model(trainable=False) if cfg.needs_ref_model else None
        # With LoRA only the adapters require gradients: only they are in the optimizer.
        trained = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = self.strategy.wrap(self.model, torch.optim.AdamW(trained, **self._optimizer_hparams()))
        self.optimizer_steps = 0
        """Optimizer steps taken so far (ppo_epochs x mini_batches per training step; the policy version, steps
        trained, is the runtime's: runtime/loop.py)."""
        self.train_steps = 0
        """Training steps done (train_step calls; restored from the trainer's step on load_checkpoint): the LR
        schedule's clock, which verl steps once per training step, not per optimizer step."""
        config = self.model.config
        self.vocab_size: int = min(config.vocab_size, self._tokenizer_vocab or config.vocab_size)
        """Token ids the learner accepts and scores (the tokenizer's; the model's if there is no tokenizer)."""
        self.pad_id: int = config.pad_token_id if config.pad_token_id is not None else 0

    # ------------------------------------------------------------------ setup

    def _optimizer_hparams(self) -> dict[str, Any]:
        cfg = self.cfg
        return dict(lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay)

    def _load_model(self, trainable: bool) -> PreTrainedModel:
        # Master weights in float32; a lower compute dtype is applied by the strategy (autocast or its own). The
        # strategy loads, moves and shards (FSDP2: on the meta device, filled from rank 0's copy).
        def prepare(model: PreTrainedModel) -> None:
            if trainable and self.cfg.lora:
                self._add_adapters(model)
            vocab = self._tokenizer_vocab if self._tokenizer_vocab and self._tokenizer_vocab < model.config.vocab_size \
                else None
            prepare_model(model, self.cfg.logprob_chunk, vocab)
            if trainable and self.cfg.gradient_checkpointing:
                # transformers 5 renamed gradient_checkpointing_enable (deprecated) to activation_checkpointing_enable.
                enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
                enable()
                if self.cfg.lora:  # frozen embeddings: checkpointed blocks still need inputs that require grad
                    model.enable_input_require_grads()
            if not trainable:
                model.requires_grad_(False)

        model = self.strategy.load_model(self.model_path, prepare)
        # Dropout off in every pass, so the recomputed old log-probs and the trained ones come from one function.
        # Exception: HF runs gradient checkpointing only in training mode (the config's dropout then applies).
        model.train(trainable and self.cfg.gradient_checkpointing)
        return model

    def _add_adapters(self, model: PreTrainedModel) -> None:
        """peft's LoRA layers injected in place (the model stays the HF model, so tree attention, the log-prob head
        and FSDP2's per-layer sharding see the same module tree); every base weight frozen. A's initialisation is
        seeded alike on every rank (FSDP2 takes rank 0's anyway)."""
        from peft import inject_adapter_in_model

        cfg = self.cfg
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            inject_adapter_in_model(peft_lora_config(cfg.lora_rank, cfg.lora_alpha, cfg.peft_target_modules,
                                                     str(self.model_path)), model)
        for name, param in model.named_parameters():
            param.requires_grad_(".lora_A." in name or ".lora_B." in name)

    def close(self) -> None:
        """Release the process group this Learner created (if any)."""
        self.strategy.close()

    # ------------------------------------------------------------------ forward

    def _forward(self, module: torch.nn.Module, model: PreTrainedModel, mb: packing.MicroBatch,
                 entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        with self.strategy.autocast():
            return micro_batch_logprobs(module, model, mb, self.cfg.temperature, entropy)

    def _micro_batches(self, indices: list[packing.TreeIndex], weights: list[packing.TreeWeights]):
        """This rank's micro-batches, then dummy ones (None) up to the largest count on any rank."""
        cfg = self.cfg
        plans = packing.plan(indices, cfg.packing, cfg.micro_batch_tokens, cfg.micro_batch_size)
        n = int(self.strategy.all_reduce([len(plans)], op="max")[0])
        for items in plans:
            yield self._build(items, indices, weights)
        for _ in range(n - len(plans)):
            yield None

    def _build(self, items: list, indices, weights) -> packing.MicroBatch:
        if self.cfg.packing == "tree":
            return packing.packed_micro_batch(items, indices, weights, self.cfg.tree_attention, self.device)
        return packing.padded_micro_batch(items, indices, weights, self.pad_id, self.device)

    def _dummy(self) -> packing.MicroBatch:
        """A 2-token pass, for a rank that has run out of micro-batches (FSDP2's collectives run in every forward
        and backward); its loss is multiplied by 0."""
        ix = packing.TreeIndex(TrainTree([self.pad_id], [-1, 0], [[], [self.pad_id]], [1], [0.0]))
        w = packing.loss_weights(ix, "token-mean", [1.0, 1.0, 1.0])
        items = packing.plan([ix], self.cfg.packing, self.cfg.micro_batch_tokens, 1)[0]
        return self._build(items, [ix], [w])

    # ------------------------------------------------------------------ public API

    def _trees(self, batch) -> list[packing.TreeIndex]:
        return [packing.TreeIndex(t) for t in as_trees(batch, "batch", self.vocab_size)]

    @torch.no_grad()
    def node_logprobs(self, indices: list[packing.TreeIndex]) -> NodeValues:
        """Log-probs of every trained token of every tree under the current weights, per tree and node."""
        out: NodeValues = [[np.zeros(len(t)) for t in ix.tree.tokens] for ix in indices]
        weights = [packing.loss_weights(ix, "token-mean", [1.0, 1.0, 1.0]) for ix in indices]  # not used here
        for mb in self._micro_batches(indices, weights):
            if mb is None:  # this rank is done; the others still run forwards
                self._forward(self.model, self.model, self._dummy())
                continue
            values = self._forward(self.model, self.model, mb)[0].double().cpu().numpy()
            for s in mb.scored:
                out[s.tree][s.node] = values[s.start:s.start + s.length]
        return out

    def compute_logprobs(self, batch: list) -> list:
        """Log-probs under the current weights (no gradient): per TrainSample its response tokens', per TrainTree
        one list per node."""
        indices = self._trees(batch)
        values = self.node_logprobs(indices)
        return [v[1].tolist() if isinstance(item, TrainSample) else [x.tolist() for x in v]
                for item, v in zip(batch, values)]

    def train_step(self, batch: list) -> dict[str, float]:
        """ppo_epochs x mini_batches optimizer steps on this rank's share of the batch (TrainTree and/or
        TrainSample items); returns global metrics.

        A step whose loss or gradient norm is NaN/inf is skipped on every rank (weights and optimizer state
        untouched) and counted in "skipped".
        """
        started = time.perf_counter()
        cfg = self.cfg
        indices = self._trees(batch)
        self._check_behaviour(indices)
        trees, seqs, tokens, unique = self.strategy.all_reduce(
            [len(indices), sum(len(ix.paths) for ix in indices), packing.denominators(indices)[0],
             sum(ix.tokens for ix in indices)])
        if seqs == 0:
            raise ValueError("train_step got no trees on any rank")
        old = self.node_logprobs(indices) if cfg.recompute_pass else None
        lr = lr_at(cfg.lr, cfg.lr_warmup_steps, self.train_steps)  # schedule.py: one LR for the whole step
        set_lr(self.optimizer, lr)
        start = self.optimizer_steps
        totals: dict[str, float] = {}
        steps = skipped = 0
        for epoch in range(cfg.ppo_epochs):
            # Deterministic shuffle of the trees: the same (seed, optimizer steps, epoch, rank) gives the same
            # mini-batches.
            order = np.random.default_rng([cfg.seed, start, epoch, self.rank]).permutation(len(indices))
            for part in np.array_split(order, cfg.mini_batches):
                part = [int(i) for i in part]
                stats = self._optimizer_step([indices[i] for i in part],
                                             None if old is None else [old[i] for i in part])
                if stats is None:
                    continue
                steps += 1
                skipped += int(stats.pop("skipped"))
                for k, v in stats.items():
                    totals[k] = max(totals.get(k, v), v) if k == "is_weight_max" else totals.get(k, 0.0) + v
        metrics = {k: v if k == "is_weight_max" else v / max(steps, 1) for k, v in totals.items()}
        self.train_steps += 1
        metrics.update(lr=lr, tokens=float(tokens), samples=float(seqs),
                       trees=float(trees), unique_tokens=float(unique), steps=float(steps - skipped),
                       skipped=float(skipped), optimizer_steps=float(self.optimizer_steps), recomputed=float(old is not None),
                       time_s=time.perf_counter() - started)
        return metrics

    def _check_behaviour(self, indices: list[packing.TreeIndex]) -> None:
        if self.cfg.off_policy == "recompute":
            return
        for i, ix in enumerate(indices):
            if ix.tree.logprobs is None:
                raise ValueError(f"learner.off_policy = {self.cfg.off_policy!r} needs the behaviour log-probs, but "
                                 f"batch[{i}] has none (TrainTree.logprobs / TrainSample.old_logprobs)")

    def per_group_grad_norms(self, groups: list[list]) -> list[float]:
        """L2 norm of the gradient of each group's loss taken alone, at the current weights (CATPO's H1 check: a
        group is one tree, the result its per-tree gradient norm).

        The loss is train_step's, normalised over the group alone, at ratio 1 (the old log-probs are the current
        ones: the clipped surrogate's gradient is then the plain policy gradient). No optimizer step; gradients
        are left cleared. Call on all ranks, each with its share of every group. Not supported under DeepSpeed
        (it owns the gradients)."""
        self.strategy.require_own_gradients("per_group_grad_norms")
        norms = []
        self.optimizer.zero_grad(set_to_none=True)
        for g, group in enumerate(groups):
            group = list(group)
            if not group and self.world_size == 1:
                raise ValueError(f"groups[{g}] is empty; every group needs at least one tree")
            figures = self.backward(group, off_policy="recompute")
            norms.append(self.strategy.grad_norm() if figures else 0.0)
            self.optimizer.zero_grad(set_to_none=True)
        return norms

    def _optimizer_step(self, indices: list[packing.TreeIndex], old: NodeValues | None) -> dict[str, float] | None:
        """Accumulate gradients over micro-batches (and ranks), then clip and step. None if no rank has trees."""
        figures = self._backward(indices, old, self.cfg.off_policy)
        if not figures:
            return None
        grad_norm, ok = self.strategy.step(figures["loss"])
        self.optimizer_steps += int(ok)
        return figures | {"grad_norm": grad_norm, "skipped": float(not ok)}

    def backward(self, batch: list, old: list | None = None, off_policy: str | None = None) -> dict[str, float]:
        """Add to the parameters' .grad the gradient of the loss of one mini-batch, of which `batch` is this rank's
        share, normalised over the whole mini-batch on all ranks; no optimizer step. `old`: the PPO old log-probs
        per tree and node (None: the pass's own, i.e. ratio 1 under recompute). Returns the figures of the whole
        mini-batch ({} when no rank has trees)."""
        indices = self._trees(batch)
        off_policy = off_policy or self.cfg.off_policy
        if off_policy != "recompute":
            self._check_behaviour(indices)
        return self._backward(indices, None if old is None else [[np.asarray(n) for n in t] for t in old], off_policy)

    def _backward(self, indices: list[packing.TreeIndex], old: NodeValues | None, off_policy: str) -> dict:
        cfg = self.cfg
        denoms = self.strategy.all_reduce(packing.denominators(indices))
        if denoms[1] == 0:
            return {}
        if cfg.loss.aggregation == "node-mean" and any(ix.tree.node_advantages is None for ix in indices):
            raise ValueError("learner.loss.aggregation = 'node-mean' needs per-node advantages (algo.name treerpo or "
                             "catpo)")
        weights = [packing.loss_weights(ix, cfg.loss.aggregation, denoms) for ix in indices]
        behaviour = ([[np.asarray(lp, dtype=np.float64) for lp in ix.tree.logprobs] for ix in indices]
                     if off_policy != "recompute" or all(ix.tree.logprobs is not None for ix in indices) else None)
        sums = dict.fromkeys(TREE_FIGURES + ("is_count", "is_weight_sum", "is_capped", "rollout_kl",
                                             "forward_tokens"), 0.0)
        is_max = 0.0
        batches = list(self._micro_batches(indices, weights))
        for k, mb in enumerate(batches):
            dummy = mb is None
            if dummy:
                mb = self._dummy()
            logp, entropy = self._forward(self.strategy.train_module, self.model, mb, entropy=True)
            if dummy:
                prox = logp.detach()
                behav = None
            else:
                prox = logp.detach() if old is None else self._tensor(mb.gather(old))
                behav = None if behaviour is None else self._tensor(mb.gather(behaviour))
            # PPO's old log-probs and the decoupled behaviour weight (AReaL: pi_prox / pi_behav, capped).
            old_lp = behav if off_policy == "behaviour" and behav is not None else prox
            b_weight = None
            if behav is not None:
                iw = torch.exp(prox - behav)
                capped = iw > cfg.behaviour_cap
                if off_policy == "decoupled":
                    b_weight = (iw.clamp(max=cfg.behaviour_cap) if cfg.behaviour_cap_mode == "truncate"
                                else torch.where(capped, torch.zeros_like(iw), iw))
            ref = None
            if self.ref_model is not None:
                with torch.no_grad():
                    ref, _ = self._forward(self.ref_model, self.ref_model, mb)
            loss, figs = tree_policy_loss(logp, old_lp, mb.weights, cfg.loss, ref_logprobs=ref, entropy=entropy,
                                          behaviour_weight=b_weight)
            scale = 0.0 if dummy else float(self.world_size)
            # FSDP2 and DeepSpeed average gradients over ranks; multiplying by world_size turns that into the sum.
            self.strategy.backward(loss * scale, last=k == len(batches) - 1)
            if dummy:
                continue
            count = mb.weights[:, packing.COUNT].to(logp.dtype)
            stats = {**figs}
            sums["forward_tokens"] += mb.forward_tokens
            if behav is not None:
                stats.update(is_count=count.sum(), is_weight_sum=(count * iw).sum(), is_capped=(count * capped).sum(),
                             rollout_kl=(count * (iw - 1 - (prox - behav))).sum())  # k3, tokens drawn from behav
                is_max = max(is_max, float(iw.max()))
            values = torch.stack([torch.as_tensor(v, dtype=torch.float64) for v in stats.values()]).tolist()
            for name, v in zip(stats, values):
                sums[name] += v
        names = list(sums)
        totals = dict(zip(names, self.strategy.all_reduce([sums[n] for n in names])))
        is_max = self.strategy.all_reduce([is_max], op="max")[0]
        out = {k: totals[k] for k in LOSS_FIGURES + ("forward_tokens",)}
        out.update({k: totals[k] / max(totals["count"], 1.0) for k in TOKEN_FIGURES})
        if totals["is_count"] > 0:
            n = totals["is_count"]
            out.update(is_weight_mean=totals["is_weight_sum"] / n, is_weight_capped=totals["is_capped"] / n,
                       rollout_kl=totals["rollout_kl"] / n, is_weight_max=is_max)
        return out

    def _tensor(self, values: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(values).to(self.device, torch.float32)

    # ------------------------------------------------------------------ weights and checkpoints

    def export_weights(self) -> dict[str, torch.Tensor]:
        """Full (unsharded) float32 CPU weights under HF parameter names; with world_size > 1 only rank 0 gets
        them ({} elsewhere). Copies: training on does not change what was exported. With LoRA the merged weights
        (W + B @ A * scaling under the base model's names; the training copy unchanged). Call on all ranks."""
        return merged_state_dict(self.strategy.export_weights(), lora_layers(self.model))

    def trainable_parameters(self) -> int:
        """Parameters the optimizer trains (with LoRA the adapters' alone), on this rank."""
        return sum(p.numel() for p in self.model.parameters() if p.requires_grad)

    def save_checkpoint(self, directory: str | Path, trainer_state: dict) -> str:
        """Write HF weights + tokenizer, optimizer state, learner and trainer state, and every rank's RNG state to
        `directory`, atomically (see checkpoint.py). Raises RuntimeError, leaving any older checkpoint intact,
        when the write fails. Call on all ranks."""
        return write_checkpoint(directory, trainer_state, strategy=self.strategy, model=self.model,
                                tokenizer=self.tokenizer, optimizer_steps=self.optimizer_steps, config=self.cfg)

    def load_checkpoint(self, directory: str | Path) -> dict:
        """Restore weights, optimizer state, optimizer steps and this rank's RNG from `directory`; return trainer_state.
        Call on all ranks. A checkpoint with full optimizer state (FSDP2 or one process) resumes at any world size
        (RNG then restarts from the seed); a DeepSpeed one only under DeepSpeed at its own world size."""
        self.optimizer_steps, trainer_state = read_checkpoint(directory, strategy=self.strategy, config=self.cfg)
        self.train_steps = int(trainer_state.get("step", 0))  # the LR schedule's clock (job/state.py: steps done)
        # The config in force rules the hyper-parameters (a resumed run may change, say, the learning rate).
        for group in self.optimizer.param_groups:
            group.update(self._optimizer_hparams())
        return trainer_state
