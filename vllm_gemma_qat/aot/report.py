"""What `compile` found, per program and per chip, and its verdict."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

# HBM bandwidth per chip, public Cloud TPU specifications (bytes / s): used
# only to turn the KV bytes a step reads into time, which RPA v3 does not
# declare to XLA's cost model.
HBM_BYTES_PER_S = {5: 819e9, 6: 1640e9}

# What Program.record reads from a compiled program, and the compile's time.
ANALYSIS = ("compile_s", "argument_bytes", "output_bytes", "alias_bytes",
            "temp_bytes", "code_bytes", "flops", "bytes_accessed",
            "optimal_seconds", "concat_bitcasts", "mosaic_calls")


@dataclass
class Program:
    name: str  # the runner's: "worker0 backbone", "worker0 sample"
    shape: dict  # its signature: num_tokens, num_reqs, ...
    ok: bool = False
    error: str | None = None
    compile_s: float = 0.0
    argument_bytes: int = 0
    output_bytes: int = 0
    alias_bytes: int = 0
    temp_bytes: int = 0
    code_bytes: int = 0
    flops: float = 0.0
    bytes_accessed: float = 0.0
    optimal_seconds: float = 0.0
    concat_bitcasts: int = 0
    mosaic_calls: int = 0  # Pallas kernels in the compiled program
    kv_read_bytes: int = 0  # by arithmetic (RPA declares none)
    est_seconds: float | None = None  # corrected, KV traffic added
    # answered from an earlier compile of the same program (analyses.py);
    # compile_s is then that compile's
    kept: bool = False

    @property
    def is_step(self) -> bool:  # the model's forward pass
        return "backbone" in self.name

    @property
    def label(self) -> str:
        return self.name + "(" + ", ".join(
            f"{k}={int(v) if isinstance(v, bool) else v}"
            for k, v in self.shape.items()) + ")"

    def record(self, compiled) -> None:
        """memory_analysis, cost_analysis and a census of the compiled
        program's custom calls."""
        self.ok = True
        mem = compiled.memory_analysis()
        self.argument_bytes = mem.argument_size_in_bytes
        self.output_bytes = mem.output_size_in_bytes
        self.alias_bytes = mem.alias_size_in_bytes
        self.temp_bytes = mem.temp_size_in_bytes
        self.code_bytes = mem.generated_code_size_in_bytes
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        self.flops = float(cost.get("flops", 0.0))
        self.bytes_accessed = float(cost.get("bytes accessed", 0.0))
        self.optimal_seconds = float(cost.get("optimal_seconds", 0.0))
        text = compiled.as_text()
        self.concat_bitcasts = text.count(
            'custom_call_target="ConcatBitcast"')
        self.mosaic_calls = text.count('custom_call_target="tpu_custom_call"')

    def analysis(self) -> dict:
        """What `record` read from the compiled program (and how long the
        compile took): what analyses.py keeps."""
        return {name: getattr(self, name) for name in ANALYSIS}

    def replay(self, analysis: dict) -> None:
        """`record` from a kept analysis."""
        self.ok, self.kept = True, True
        for name in ANALYSIS:
            setattr(self, name, analysis[name])


@dataclass
class Report:
    model: str
    topology: str
    tp: int
    weights: str
    kv_dtype: str
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    num_blocks: int
    hbm_bytes: int  # per chip
    utilization: float
    programs: list = field(default_factory=list)
    hosts: int = 1  # hosts the TP chips span
    # per chip
    weight_bytes: int = 0  # every parameter's shard (what HBM holds)
    lm_weight_bytes: int = 0  # the language model's part of it
    step_weight_bytes: int = 0  # memory_analysis: step args - KV - inputs
    # memory_analysis of a program taking every language-model parameter:
    # their bytes as laid out in HBM (TPU tiling pads small dimensions)
    lm_laid_out_bytes: int = 0
    # speculative decoding (--assistant): the drafter's parameters per chip
    # that are not the target's (in weight_bytes), and plan's figure
    assistant: str | None = None
    num_speculative_tokens: int = 0
    assistant_weight_bytes: int = 0
    plan_assistant_weight_bytes: int | None = None
    kv_bytes: int = 0  # the KV cache's shards
    max_temp_bytes: int = 0
    max_code_bytes: int = 0
    plan_weight_bytes: int = 0
    plan_lm_weight_bytes: int = 0  # the language model's (what a step takes)
    plan_kv_bytes: int = 0
    plan_kv_cache_tokens: int = 0
    plan_num_blocks: int = 0
    fits: bool = False
    why_not: list = field(default_factory=list)
    disagreements: list = field(default_factory=list)
    caveats: list = field(default_factory=list)
    build_s: float = 0.0

    @property
    def all_compiled(self) -> bool:
        return bool(self.programs) and all(p.ok for p in self.programs)

    def as_dict(self) -> dict:
        d = asdict(self)
        d["all_compiled"] = self.all_compiled
        d["total_bytes"] = self.total_bytes
        return d

    @property
    def total_bytes(self) -> int:
        return (self.weight_bytes + self.kv_bytes + self.max_temp_bytes
                + self.max_code_bytes)


def judge(report: Report) -> None:
    ok = [prog for prog in report.programs if prog.ok]
    report.max_temp_bytes = max((prog.temp_bytes for prog in ok), default=0)
    report.max_code_bytes = max((prog.code_bytes for prog in ok), default=0)
    if report.lm_weight_bytes != report.plan_lm_weight_bytes:
        report.disagreements.append(
            f"language-model weights per chip: the built model's parameters "
            f"{report.lm_weight_bytes} B, plan {report.plan_lm_weight_bytes} B")
    towers = report.weight_bytes - report.lm_weight_bytes
    plan_towers = report.plan_weight_bytes - report.plan_lm_weight_bytes
    if towers > plan_towers:  # plan counts them whole: an upper bound
        report.disagreements.append(
            f"towers per chip: the built model's {towers} B, more than "
            f"plan's whole-tower bound {plan_towers} B")
    if not report.programs and not report.why_not:
        report.why_not.append("no program compiled (the flags leave out "
                              "every program the runner compiles)")
    if any(prog.name.endswith(" backbone") for prog in ok) and \
            report.step_weight_bytes != report.lm_laid_out_bytes:
        report.disagreements.append(
            f"language-model weights per chip: the compiled step's "
            f"arguments {report.step_weight_bytes} B, the parameters as "
            f"laid out in HBM {report.lm_laid_out_bytes} B")
    helper, plan_helper = (report.assistant_weight_bytes,
                           report.plan_assistant_weight_bytes)
    if report.assistant and plan_helper is not None and (
            helper > plan_helper or report.tp == 1 and helper != plan_helper):
        report.disagreements.append(
            f"assistant weights per chip: the built drafter's {helper} B "
            f"(its embedding is the target's), plan {plan_helper} B")
    if report.kv_bytes != report.plan_kv_bytes and not report.why_not:
        report.disagreements.append(
            f"KV cache per chip: compiled {report.kv_bytes} B, plan "
            f"{report.plan_kv_bytes} B")
    if report.total_bytes > report.hbm_bytes:
        report.why_not.append(
            f"weights + KV + largest temporary + code "
            f"{report.total_bytes / 1e9:.2f} GB exceed the chip's "
            f"{report.hbm_bytes / 1e9:.2f} GB of HBM")
    report.fits = report.all_compiled and not report.why_not
    report.caveats[:0] = [
        "est. seconds are XLA's cost model, not a measurement: optimal_seconds "
        "+ 1 per ConcatBitcast custom call (it comes out negative by exactly "
        "that count) + the KV bytes the step's attention reads at the chip's "
        "nominal HBM bandwidth (RPA v3 declares no cost; worst case: every "
        "request of the bucket at --max-model-len, capped by the cache)",
        "step weights per chip = the compiled step's argument bytes "
        "(memory_analysis) - those of its KV cache and inputs (a program "
        "taking only them); the towers are not its arguments (XLA drops "
        "unused ones); it includes TPU tile padding of small dimensions, "
        "which plan's byte counts (and the parameters' logical bytes) do not",
        "plan counts a vision tower whole on every chip (an upper bound); "
        "tpu-inference splits its attention and MLP under TP",
    ] + ([
        "plan counts the assistant whole on every chip (an upper bound "
        "under TP); the drafter's programs use the target's KV cache and "
        "embedding (no KV of its own)"] if report.assistant else [])
