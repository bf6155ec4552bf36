"""The rollout stage: sample agent plans / workflows for round k and write `queries` and `generations`.

Flat (SPOGW): m workflows per query. Two-level: N_A agent plans per query, then N_W workflows per plan.
One prompt per (query) or (agent), sampled n times; its exemplars are drawn once per prompt.
Idempotent per (query, parent, slot): gen_ids are deterministic, so a re-run samples only missing slots
(two-level: missing agents first, then the missing workflows of the agents that exist). Every generation
batch writes one Parquet part when its call ends, so a crash loses at most the call in flight (its batches; under
rollout.choice_step also the batches whose labels are drawn and whose workflows are not written yet: `Sampler.sample`).
Row conventions: `latency_s` is the call's wall time divided by the samples it returned; `token_logprobs`
follow pipeline/engines/generation/base.py; `adapter_round` is the round whose checkpoint sampled (null: base model
or round 0's generator.adapter, whose path is in `sampling`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from pipeline.core.designs import OWN, declared_choice, nearest_design, tempered_draws, tempered_log_probs
from pipeline.engines.benchmarks.base import Benchmark, Item, load_benchmark
from pipeline.engines.executors import cost_usd
from pipeline.engines.generation import BACKENDS, Completion, Generator, Sampling, make_generator
from pipeline.engines.meter import ProgressMeter, relay_path
from pipeline.engines.models import load_tokenizer
from pipeline.engines.prompting import (
    Design,
    PromptError,
    agent_prompt,
    agent_system,
    load_design,
    menu_code,
    menu_labels,
    render,
    require_chat_template,
    workflow_prompt,
)
from pipeline.engines.workflow import check_workflow, extract_code
from pipeline.run import RunContext, derived_seed
from pipeline.stages.exemplars import Pools, load_pools, pick_exemplars, tau_at
from pipeline.stages.logged import import_logged
from pipeline.stages.modes import get_mode
from pipeline.stages.repair import self_repair
from pipeline.stages.sampling import Request, batches, draw_design, gen_id, opening, seeded_rng, stops

log = logging.getLogger(__name__)


class RolloutError(RuntimeError):
    """The rollout cannot start (missing adapter, bad backend); nothing has been written."""


def resolve_adapter(ctx: RunContext) -> tuple[str | None, int | None]:
    """(adapter folder, its round): round k−1's checkpoint; at round 0 generator.adapter if set, else the base model.
    Training starts round k from the same adapter (pipeline.stages.train.policy.start_adapter), so the policy that
    samples a round is the π_old its training uses."""
    if ctx.round > 0:
        path, rnd = ctx.store.checkpoint_dir(ctx.run_id, ctx.round - 1), ctx.round - 1
    elif ctx.cfg.generator.adapter:
        path, rnd = ctx.cfg.generator.adapter, None
    else:
        return None, None
    local = ctx.store.local_adapter(path)  # an s3:// checkpoint: downloaded into the local cache when complete
    if local is None or not (local / "adapter_config.json").is_file():
        hint = ("set generator.adapter to an existing peft adapter folder" if rnd is None
                else f"train round {rnd} first (`pipeline train CONFIG --run-id {ctx.run_id} --round {rnd}`)")
        raise RolloutError(f"adapter folder {path} is missing (no adapter_config.json): {hint}")
    return str(local.resolve()), rnd


def exemplar_source(ctx: RunContext) -> tuple[str, int]:
    """(run, round) whose prompt construction this rollout copies: exemplars come from that run's rounds below
    that round. A run's own (run, round) by default; an evaluation run names the trained run and round k+1,
    so checkpoint k is evaluated on prompts built exactly as round k+1's training prompts."""
    ro = ctx.cfg.rollout
    if ro.exemplar_run is None:
        return ctx.run_id, ctx.round
    return ro.exemplar_run, ctx.round if ro.exemplar_round is None else ro.exemplar_round


def exemplar_pools(ctx: RunContext) -> Pools:
    if ctx.cfg.rollout.exemplars == "none":
        return Pools()
    run, k = exemplar_source(ctx)
    return load_pools(ctx.store, run, k, ctx.cfg.rollout.r_min_agent, ctx.cfg.rollout.r_min_workflow)


def _validate(kind: str, text: str, max_chars: int) -> str | None:
    if kind == "agent":
        return None if text.strip() else "empty plan"
    return check_workflow(extract_code(text), max_chars)


class Sampler:
    def __init__(self, ctx: RunContext, items: list[Item], family: str, tokenizer, pools: Pools,
                 adapter: str | None, adapter_round: int | None):
        self.ctx, self.cfg = ctx, ctx.cfg
        self.items, self.family, self.tokenizer, self.pools = items, family, tokenizer, pools
        self.adapter, self.adapter_round = adapter, adapter_round
        self.sample_adapter = adapter  # what the engine applies: None when the adapter is merged into its weights
        self.prompt_round = prompt_round = exemplar_source(ctx)[1]
        # the example menu; its designs by name, to name the design each written workflow follows
        self.menu = [load_design(p) for p in self.cfg.rollout.example_menu]
        self.menu_code = menu_code(self.cfg.rollout.example_menu)
        self.menu_names = [d.name for d in self.menu]
        self.menu_labels = menu_labels(self.menu) if self.menu else {}
        # rollout.choice_step: the token each design's label starts with after workflow_prefix
        # with route_or_write, `own` is one more label: the one under which the generator writes its own workflow
        labels = self.menu_labels | ({OWN: self.cfg.rollout.own_label} if self.cfg.rollout.route_or_write else {})
        self.choice_tokens = choice_tokens(tokenizer, self.cfg.rollout.workflow_prefix, labels) \
            if self.cfg.rollout.choice_step else {}
        self.routes = {d.name: d for d in self.menu} if self.cfg.rollout.route_or_write else {}
        self.tau_a = tau_at(self.cfg.rollout.tau_agent, self.cfg.rollout.tau_decay, prompt_round)
        self.tau_w = tau_at(self.cfg.rollout.tau_workflow, self.cfg.rollout.tau_decay, prompt_round)

    def existing(self) -> dict[str, dict]:
        df = self.ctx.store.read("generations", self.ctx.run_id, self.ctx.round)
        cols = ("gen_id", "kind", "query_id", "text", "exemplar_ids")
        return {r["gen_id"]: r for r in df.select(*cols).iter_rows(named=True)}

    def _request(self, kind: str, item: Item, n: int, have: dict, parent: dict | None = None) -> list[Request]:
        """The prompts of a query's (or agent's) missing slots: one, or with an example menu one per drawn design."""
        parent_id = parent["gen_id"] if parent else None
        slots = [s for s in range(n) if gen_id(self.ctx.round, item.id, kind, s, parent_id) not in have]
        if not slots:
            return []
        if kind != "workflow" or not self.menu or self.cfg.rollout.menu_choice == "policy":
            return [self._prompt(kind, item, slots, parent)]  # policy: one prompt shows the whole menu
        drawn: dict[int, list[int]] = {}
        for s in slots:
            drawn.setdefault(draw_design(self.cfg.rollout.menu_seed, item.id, s, len(self.menu)), []).append(s)
        return [self._prompt(kind, item, group, parent, self.menu[d]) for d, group in sorted(drawn.items())]

    def _prompt(self, kind: str, item: Item, slots: list[int], parent: dict | None,
                design: Design | None = None) -> Request:
        parent_id = parent["gen_id"] if parent else None
        key = parent_id or f"{kind}:{item.id}"
        # keyed by the prompt's round (not the run's): an evaluation of checkpoint k picks the exemplars that
        # round k+1 of training picked for the same query
        rng = seeded_rng(self.cfg.generator.seed, f"{self.prompt_round}:{key.removeprefix(f'r{self.ctx.round}-')}")
        if kind == "agent":
            shown = pick_exemplars(self.pools.agent_pool(item.id), self.tau_a, rng)
            user = agent_prompt(item.prompt, shown, self.cfg.rollout.prompt_dir, self.menu)
            max_tokens = self.cfg.rollout.max_plan_tokens
        else:
            shown, stored_plan = self._workflow_exemplars(item, parent, rng)
            user = workflow_prompt(item.prompt, self.family, shown, parent["text"] if parent else None, stored_plan,
                                   self.cfg.rollout.prompt_dir, design, self.menu)
            max_tokens = self.cfg.generator.max_new_tokens
        prefix = opening(self.cfg.rollout, design) if kind == "workflow" else ""
        return Request(kind, item.id, parent_id, [gen_id(self.ctx.round, item.id, kind, s, parent_id) for s in slots],
                       slots, render(self.tokenizer, user, agent_system(self.cfg.rollout.prompt_dir) if kind == "agent"
                                     else None, self.cfg.rollout.prompt_dir) + prefix,
                       [s.gen_id for s in shown], max_tokens, prefix, None if design is None else design.name)

    def workflow_request(self, item: Item) -> Request:
        """The flat workflow prompt this round renders for `item` (one slot): what a logged row is trained under."""
        return self._prompt("workflow", item, [0], None)

    def _workflow_exemplars(self, item: Item, parent: dict | None, rng: random.Random) -> tuple[list, str | None]:
        """Flat: the query's pool. Two-level: D_W of the stored agent the plan was conditioned on, and that
        agent's plan text (None: no exemplars)."""
        if parent is None:
            return pick_exemplars(self.pools.workflow_pool(item.id), self.tau_w, rng), None
        source = self.pools.buffer_agent(parent.get("exemplar_ids") or [])
        if source is None:
            return [], None
        return pick_exemplars(self.pools.workflows_by_agent[source], self.tau_w, rng), self.pools.plans[source]

    def requests(self, have: dict) -> list[Request]:
        """What is missing now: flat workflows, or two-level agents, then workflows under existing agents."""
        mode, out = self.cfg.rollout.mode, []
        for item in self.items:
            if mode == "flat":
                out += self._request("workflow", item, self.cfg.rollout.m, have)
                continue
            out += self._request("agent", item, self.cfg.rollout.n_agents, have)
            agents = sorted((r for r in have.values() if r["kind"] == "agent" and r["query_id"] == item.id),
                            key=lambda r: r["gen_id"])
            out += [r for a in agents for r in self._request("workflow", item, self.cfg.rollout.n_workflows, have, a)]
        return out

    def sampling(self, batch: list[Request]) -> Sampling:
        g = self.cfg.generator
        seed = derived_seed(g.seed, "sampling", self.ctx.round, batch[0].gen_ids[0])
        return Sampling(n=len(batch[0].slots), temperature=g.temperature, top_p=g.top_p,
                        max_new_tokens=batch[0].max_new_tokens, seed=seed, stop=stops(g, batch[0].kind))

    def choice_provenance(self, req: Request, completion: Completion) -> dict:
        """What a row's `sampling` adds under rollout.choice_step: the design token's temperature and candidates, the
        policy's own odds over the designs (renormalised, before the temperature): how the policy's choice moves
        round over round, whatever the exploration drew; and the drawn label's log-prob under the model's own
        distribution over the whole vocabulary (`logprob`: π_old of the label, training.old_logprobs: rollout; the
        row's first token log-prob is the draw's)."""
        if not self.choice_tokens or req.kind != "workflow":
            return {}
        ro = self.cfg.rollout
        return {"choice_step": {"temperature": ro.choice_temperature or self.cfg.generator.temperature,
                                "tokens": self.choice_tokens, "odds": completion.extra.get("choice_odds"),
                                "logprob": completion.extra.get("label_logprob")}}

    def draw_labels(self, gen: Generator, batch: list[Request], sampling: Sampling,
                    progress: Callable[[int], None] | None = None) -> Drawn:
        """rollout.choice_step, its first step: per slot, the design token drawn from the policy's odds over the
        labels' first tokens (renormalised over them, at choice_temperature: any temperature, not only what an
        engine's sampler takes); its log-prob the one it was drawn with, the policy's own in the row's `sampling`
        (`choice_provenance`). What is left to write after the labels is `write_after`'s. `progress`: told of each
        routed label (a whole completion)."""
        started = time.perf_counter()
        ids, names = list(self.choice_tokens.values()), list(self.choice_tokens)
        temperature = self.cfg.rollout.choice_temperature or sampling.temperature
        odds = gen.next_token_logprobs([r.prompt_text for r in batch], ids, self.sample_adapter)
        picks = []
        for request, label_logprobs in zip(batch, odds, strict=True):
            prompt_ids = self.tokenizer(request.prompt_text, add_special_tokens=False).input_ids
            own = {name: round(math.exp(logprob), 6)
                   for name, logprob in zip(self.choice_tokens, tempered_log_probs(label_logprobs, 1.0), strict=True)}
            seed = derived_seed(sampling.seed, "design", request.gen_ids[0])
            for index, logprob in tempered_draws(label_logprobs, temperature, sampling.n, seed):
                # route_or_write: a design's label is the whole completion, and its program is what runs
                route = {"route": names[index]} if names[index] in self.routes else {}
                picks.append(Completion(self.tokenizer.decode([ids[index]]), prompt_ids, [ids[index]], [logprob],
                                        "stop" if route else "length",
                                        extra={"choice_odds": own, "label_logprob": label_logprobs[index]} | route))
        then = replace(sampling, n=1, max_new_tokens=max(1, sampling.max_new_tokens - 1),
                       seed=derived_seed(sampling.seed, "after the choice"))
        to_write = [k for k, c in enumerate(picks) if "route" not in c.extra]
        if progress is not None and len(to_write) < len(picks):
            progress(len(picks) - len(to_write))
        return Drawn(batch, sampling, picks, to_write, then, time.perf_counter() - started)

    def write_after(self, gen: Generator, drawn: list[Drawn],
                    progress: Callable[[int], None] | None = None) -> list[list[list[Completion]]]:
        """rollout.choice_step, its second step: the workflow sampled after each drawn label that is not routed (one
        prompt a slot), for several batches' draws in one generation call where the backend seeds each prompt by
        itself (`Generator.per_prompt_seeds`): each prompt keeps the seed its batch's own call gives it, and the
        call decodes as many workflows as a call without the design step would. Each completion is the two steps'
        tokens joined. Per batch, per request, its n completions."""
        prompts = [d.batch[k // d.sampling.n].prompt_text + d.picks[k].text for d in drawn for k in d.to_write]
        then = one_call_sampling([(d.then, len(d.to_write)) for d in drawn])
        written = iter([comps[0] for comps in gen.generate(prompts, then, self.sample_adapter, progress=progress)]
                       if prompts else [])
        out = []
        for batch_drawn in drawn:
            joined = list(batch_drawn.picks)
            for k in batch_drawn.to_write:
                c, w = joined[k], next(written)
                joined[k] = Completion(c.text + w.text, c.prompt_token_ids, c.token_ids + w.token_ids,
                                       None if w.token_logprobs is None else c.token_logprobs + w.token_logprobs,
                                       w.finish_reason,
                                       retokenized=w.prompt_token_ids != c.prompt_token_ids + c.token_ids,
                                       extra=c.extra)
            n = batch_drawn.sampling.n
            out.append([joined[i * n:(i + 1) * n] for i in range(len(batch_drawn.batch))])
        return out

    def rows(self, req: Request, comps: list[Completion], sampling: Sampling, latency: float) -> list[dict]:
        generator = self.cfg.generator
        rows, menu_workflow = [], bool(self.menu) and req.kind == "workflow"
        for gid, slot, completion in zip(req.gen_ids, req.slots, comps, strict=True):
            route = completion.extra.get("route") if completion.extra else None
            # a routed label runs its design's program: the stored text is that program, whose code the score runs
            text = routed_text(self.routes[route]) if route else req.prefix + completion.text
            reason = _validate(req.kind, text, self.cfg.rollout.max_workflow_chars)
            rows.append(dict(
                gen_id=gid, kind=req.kind, parent_id=req.parent_id, query_id=req.query_id, slot=slot,
                prompt_text=req.prompt_text, text=text, prompt_token_ids=completion.prompt_token_ids,
                token_ids=completion.token_ids, token_logprobs=completion.token_logprobs, model=generator.model,
                backend=generator.backend, adapter_round=self.adapter_round,
                sampling=sampling.to_json(adapter=self.adapter, **self.choice_provenance(req, completion)),
                exemplar_ids=req.exemplar_ids,
                finish_reason=completion.finish_reason, valid=reason is None, invalid_reason=reason,
                retokenized=completion.retokenized, latency_s=latency, attempt=0,
                cost_usd=cost_usd(generator.prices, len(completion.prompt_token_ids or []),
                                  len(completion.token_ids or [])),
                example=req.example,
                design=nearest_design(extract_code(text), self.menu_code)[0] if menu_workflow else None,
                choice=route or (declared_choice(text, self.menu_names, self.menu_labels) if menu_workflow else None),
                source=("route" if route else "write") if self.routes and req.kind == "workflow" else None,
            ))
        return rows

    def sample(self, gen: Generator, requests: list[Request], bar: ProgressMeter) -> int:
        """Every request, `generator.batch_size` prompts a batch. Where the backend seeds each prompt by itself
        (`Generator.per_prompt_seeds`), several batches are sampled in one call of about `call_samples` samples, each
        prompt with the seed its own batch's call gives it: a call decodes until its longest sample ends, so a call
        of one small batch decodes its tail at a small batch. Under rollout.choice_step the labels are drawn a batch
        at a time and the workflows written after them are what the calls join (`write_after`). A call's batches are
        written when it ends: a crash loses at most the call in flight."""
        written, drawn, plain = 0, [], []
        for batch in batches(requests, self.cfg.generator.batch_size):
            sampling = self.sampling(batch)
            if self.choice_tokens and batch[0].kind == "workflow":
                draw = self.draw_labels(gen, batch, sampling, progress=bar.update)
                if drawn and not mergeable(drawn[0].then, draw.then):
                    written, drawn = written + self.write_drawn(gen, drawn, bar), []
                drawn.append(draw)
                if not gen.per_prompt_seeds or sum(len(d.to_write) for d in drawn) >= self.call_samples(sampling):
                    written, drawn = written + self.write_drawn(gen, drawn, bar), []
                continue
            if plain and not mergeable(plain[0][1], sampling):
                written, plain = written + self.write_plain(gen, plain, bar), []
            plain.append((batch, sampling))
            if not gen.per_prompt_seeds or sum(len(b) * s.n for b, s in plain) >= self.call_samples(sampling):
                written, plain = written + self.write_plain(gen, plain, bar), []
        return (written + (self.write_drawn(gen, drawn, bar) if drawn else 0)
                + (self.write_plain(gen, plain, bar) if plain else 0))

    def call_samples(self, sampling: Sampling) -> int:
        """The samples a call gathers before it starts (generator.call_samples; unset: one batch's)."""
        return self.cfg.generator.call_samples or self.cfg.generator.batch_size * sampling.n

    def write_plain(self, gen: Generator, plain: list[tuple[list[Request], Sampling]], bar: ProgressMeter) -> int:
        """Batches without a design step, in one call (each prompt keeps its own batch's seed), then each batch's
        rows; a row's latency is the call's wall time over its samples."""
        prompts = [r.prompt_text for batch, _ in plain for r in batch]
        sampling = one_call_sampling([(s, len(batch)) for batch, s in plain])
        t0 = time.perf_counter()
        outs = iter(gen.generate(prompts, sampling, self.sample_adapter, progress=bar.update))
        latency = (time.perf_counter() - t0) / max(1, sampling.n * len(prompts))
        return sum(self.write_rows(batch, [next(outs) for _ in batch], s, latency) for batch, s in plain)

    def write_drawn(self, gen: Generator, drawn: list[Drawn], bar: ProgressMeter) -> int:
        """The workflows after the drawn labels of `drawn`'s batches, then each batch's rows; a row's latency is its
        batch's label step and its share of the writing call, over the batch's samples."""
        t0 = time.perf_counter()
        outs = self.write_after(gen, drawn, progress=bar.update)
        write_s, total = time.perf_counter() - t0, max(1, sum(len(d.to_write) for d in drawn))
        return sum(self.write_rows(d.batch, batch_outs, d.sampling,
                                   (d.label_s + write_s * len(d.to_write) / total) / max(1, len(d.picks)))
                   for d, batch_outs in zip(drawn, outs, strict=True))

    def write_rows(self, batch: list[Request], outs: list[list[Completion]], sampling: Sampling,
                   latency: float) -> int:
        rows = [row for r, comps in zip(batch, outs, strict=True) for row in self.rows(r, comps, sampling, latency)]
        self.ctx.store.write("generations", rows, self.ctx.run_id, self.ctx.round)
        return len(rows)


@dataclass
class Drawn:
    """A batch whose design labels are drawn (`Sampler.draw_labels`): what is left is the workflows after them."""

    batch: list[Request]
    sampling: Sampling  # the batch's own (stored in its rows)
    picks: list[Completion]  # per slot, request by request: the label (a routed one is the whole completion)
    to_write: list[int]  # the picks a workflow is written after
    then: Sampling  # the writing call's sampling, as the batch alone would sample it
    label_s: float  # wall seconds of the label step


def mergeable(first: Sampling, other: Sampling) -> bool:
    """Whether two batches can be sampled in one call: the same sampling but for the seed."""
    return replace(first, seed=0) == replace(other, seed=0)


def one_call_sampling(parts: list[tuple[Sampling, int]]) -> Sampling:
    """The sampling of one call that holds several batches' prompts (each batch's sampling and its prompt count, in
    the call's order): each prompt keeps the seed its own batch's call gives it; one batch's is its own."""
    first = parts[0][0]
    if len(parts) == 1:
        return first
    return replace(first, seeds=tuple(s.prompt_seed(i) for s, count in parts for i in range(count)))


def routed_text(design: Design) -> str:
    """The stored text of a routed label (rollout.route_or_write): the design's program in a fence, as it runs."""
    return f"```python\n{design.code}\n```"


def choice_tokens(tokenizer, prefix: str, labels: dict[str, str]) -> dict[str, int]:
    """design name -> the token its label starts with right after `prefix` (a space before the label unless the
    prefix ends in one); a RolloutError when two labels start with the same token or the prefix's own tokens change."""
    base = tokenizer(prefix, add_special_tokens=False).input_ids
    out: dict[str, int] = {}
    for name, label in labels.items():
        ids = tokenizer(prefix + ("" if prefix.endswith((" ", "\n")) else " ") + label, add_special_tokens=False
                        ).input_ids
        if ids[:len(base)] != base or len(ids) == len(base):
            raise RolloutError(f"rollout.choice_step: the label {label!r} merges with the end of workflow_prefix "
                               f"{prefix!r}; end the prefix where a word starts (e.g. with `# design:`)")
        out[name] = ids[len(base)]
    if len(set(out.values())) < len(out):
        raise RolloutError(f"rollout.choice_step: labels {sorted(labels.values())} do not differ in their first "
                           "token; name the menu's programs so that they do")
    return out


def training_split_ids(bench: Benchmark) -> set[str]:
    """Every query id of the training split, not only the round's (benchmark.max_queries)."""
    return {it.id for it in bench.with_config(max_queries=None).items()}


def write_queries(ctx: RunContext, items: list[Item]) -> int:
    have = set(ctx.store.read("queries", ctx.run_id, ctx.round)["query_id"].to_list())
    rows = [dict(split=ctx.cfg.benchmark.train_split, query_id=it.id, benchmark=ctx.cfg.benchmark.name,
                 prompt=it.prompt, reference=json.dumps(it.reference), meta=json.dumps(it.meta))
            for it in items if it.id not in have]
    ctx.store.write("queries", rows, ctx.run_id, ctx.round)
    return len(rows)


def rollout_counts(ctx: RunContext, sampled: int) -> dict:
    df = ctx.store.read("generations", ctx.run_id, ctx.round)
    return dict(generations=df.height, agents=int((df["kind"] == "agent").sum()),
                workflows=int((df["kind"] == "workflow").sum()), valid=int(df["valid"].sum()), sampled_now=sampled)


def start_generator(ctx: RunContext, sampler: Sampler, stack: contextlib.ExitStack) -> Generator:
    """The round's engine. A vLLM engine on CPU samples an adapter merged into a temporary copy of the base
    weights (generator.merge_adapter), removed when the stage ends; otherwise the engine applies the adapter."""
    generator = ctx.cfg.generator
    from pipeline.engines.generation.vllm_offline import cuda_available

    merge = generator.merge_adapter == "always" or (generator.merge_adapter == "auto" and not cuda_available())
    if sampler.adapter is None or generator.backend != "vllm" or not merge:
        return make_generator(generator, enable_lora=sampler.adapter is not None)
    from pipeline.engines.hardware import resolve_dtype
    from pipeline.engines.models import cache_dir, merge_adapter

    (cache_dir() / "merged").mkdir(parents=True, exist_ok=True)
    tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="merged-", dir=cache_dir() / "merged"))
    t0 = time.perf_counter()
    folder = merge_adapter(generator.model, sampler.adapter, Path(tmp) / "model",
                           resolve_dtype(generator.dtype, what="generator"))
    log.info("adapter %s merged into %s in %.1fs (vLLM on CPU: no LoRA kernels)", sampler.adapter, folder,
             time.perf_counter() - t0)
    sampler.sample_adapter = None
    return make_generator(generator.model_copy(update={"model": str(folder)}), enable_lora=False)


def _sample_all(ctx: RunContext, sampler: Sampler, gen: Generator, todo: list[Request]) -> int:
    total = sum(len(r.slots) for r in todo)
    if ctx.cfg.rollout.mode == "two_level":  # workflows of agents sampled in this run are not known yet
        total += sum(len(r.slots) for r in todo if r.kind == "agent") * ctx.cfg.rollout.n_workflows
    sampled = 0
    relay = relay_path(ctx.run_id, ctx.round, "rollout")
    with ProgressMeter(total, f"rollout r{ctx.round}", "gen", relay=relay) as bar:
        while todo:
            sampled += sampler.sample(gen, todo, bar)
            # two-level: the agents just written unlock their workflows; flat finishes in one pass
            todo = sampler.requests(sampler.existing()) if ctx.cfg.rollout.mode == "two_level" else []
    return sampled


def run_rollout(ctx: RunContext) -> dict:
    """Sample what round `ctx.round` is missing, through the rollout mode's loop (`pipeline.stages.modes`); all input
    checks happen before anything is written."""
    cfg = ctx.cfg
    if cfg.generator.backend not in BACKENDS:
        raise RolloutError(f"unknown generation backend {cfg.generator.backend!r}; use one of {', '.join(BACKENDS)}")
    mode = get_mode(cfg.rollout.mode)
    if cfg.rollout.prompt_dir is not None and not Path(cfg.rollout.prompt_dir).is_dir():
        raise RolloutError(f"rollout.prompt_dir {cfg.rollout.prompt_dir!r} is not a folder (relative paths start at "
                           f"the working directory, {Path.cwd()})")
    for path in cfg.rollout.example_menu:  # a missing or header-less design file: before anything is written
        try:
            load_design(path)
        except PromptError as e:
            raise RolloutError(str(e)) from None
    adapter, adapter_round = resolve_adapter(ctx)
    tokenizer = load_tokenizer(cfg.generator.model)
    require_chat_template(tokenizer, cfg.generator.model)
    bench = load_benchmark(cfg.benchmark)
    sampler = Sampler(ctx, bench.items(), bench.family, tokenizer, Pools(), adapter, adapter_round)
    return mode.function("rollout")(ctx, sampler, bench)


def sample_round(ctx: RunContext, sampler: Sampler, bench: Benchmark) -> dict:
    """The flat and two-level rollout: the queries' missing slots (two-level: plans, then workflows under them),
    with exemplars from earlier rounds, then self-repair when configured."""
    cfg, items = ctx.cfg, sampler.items
    sampler.pools = exemplar_pools(ctx)
    have = sampler.existing()
    todo = sampler.requests(have)
    sampled, repaired, cache = 0, {}, None
    with contextlib.ExitStack() as stack:
        gen = start_generator(ctx, sampler, stack) if todo else None
        write_queries(ctx, items)  # after the engine started: a backend that cannot start writes nothing
        imported = import_logged(ctx, sampler, training_split_ids(bench)) if cfg.rollout.logged else 0
        if gen is not None:
            stack.callback(gen.close)
            sampled = _sample_all(ctx, sampler, gen, todo)
            cache = gen.cache_counts()  # vLLM's prefix cache over the stage's calls, where the engine keeps one
        if cfg.rollout.repair_attempts:

            def engine() -> Generator:  # a resumed rollout may have only repairs left: start the engine then
                nonlocal gen
                if gen is None:
                    gen = start_generator(ctx, sampler, stack)
                    stack.callback(gen.close)
                return gen

            repaired = {"repair": self_repair(ctx, sampler, engine)}
    counts = rollout_counts(ctx, sampled) | ({"logged_imported": imported} if cfg.rollout.logged else {})
    if cache is not None and cache.hit_rate is not None:
        counts["prefix_cache_hit_rate"] = round(cache.hit_rate, 4)
    ctx.finish("rollout", queries=len(items), **counts, **repaired)
    log.info("rollout round %d: %s", ctx.round, counts | repaired)
    return {"queries": len(items), **counts, **repaired}
