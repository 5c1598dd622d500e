"""The language-model interface every family implements, and what a family declares.

Alignment (one rule for every family, so eval and generation need no per-family code):
`logits[:, t]` is the distribution of `tokens[:, t]` given `tokens[:, :t]` and the carried
`state`. Every position is scored, position 0 included: GPN predicts it from the all-zero
state (the spec); a family without a natural carry (Transformer++) predicts it from a learned
start token that its initial state holds as the pending input.

`state` is whatever the family carries between calls (GPN: (s, s_prev, M); Gated DeltaNet:
memories and convolution caches; Transformer++: the key/value cache and the pending token).
It is opaque outside the family: callers only pass it back, `detach` it via the family, and
ask `next_token_logits(state)` for the distribution of the token after the context.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, runtime_checkable

if TYPE_CHECKING:  # annotations only: the registry resolves families without importing torch
    from torch import Tensor, nn


class LMOutput(NamedTuple):
    """What `forward` returns (GPNOutput has the same fields in the same order)."""

    loss: Tensor  # mean cross-entropy over all B*T positions
    state: Any | None  # the final carry, when `return_state`
    logits: Tensor | None = None  # (B, T, V), when `return_logits` (eval/analysis only)


@runtime_checkable
class LanguageModel(Protocol):
    """The one interface the trainer, eval, generation, sweeps and fits use."""

    config: Any

    def forward(
        self,
        tokens: Tensor,
        state: Any | None = None,
        *,
        return_state: bool = False,
        return_logits: bool = False,
    ) -> LMOutput: ...

    def initial_state(self, batch_size: int, device: Any = None) -> Any: ...

    def next_token_logits(self, state: Any) -> Tensor:
        """(B, V) logits of the token that follows the context `state` carries."""
        ...

    def num_parameters(self) -> int: ...


@dataclass(frozen=True)
class FamilySpec:
    """What a family declares (torchtitan's ModelSpec is the anchor).

    - `config_from_dict`: a validated, frozen config from the YAML mapping (one-line
      ConfigError on a bad key or value).
    - `build`: the model on the default device, initialised as the family's reference does.
    - `count_parameters(cfg)` and `flops_per_token(cfg, seq_len)`: training FLOPs per token
      (forward + backward, attention's quadratic part included where the family has it).
    - `fsdp_units(model)`: the submodules FSDP2 / ZeRO wrap on their own, in order (the root
      is wrapped last by the caller); empty = the whole model is one unit.
    - `apply_tp(model, tp_mesh)`: shard the built model over a tp mesh in place (the family's
      declarative plan applied by DTensor; GPN: parameter placements, Transformer++:
      parallelize_module styles); None when the family is not tensor-parallel.
    - `check_tp(cfg, tp)`: one ConfigError line naming the field that does not split.
    - `check_device(cfg, device_type)`: one ConfigError line when the config's kernels
      cannot run on that device type ("cpu", "cuda"), e.g. a backend forced to CUDA-only
      kernels; run before anything is created.
    - `compat_keys(cfg)`: the config fields a checkpoint must match to be resumed.
    - `recurrent`: the state is O(1) in the context length (scoring and generation reuse it).
    - `compile_blocks(model)`: the submodules `compile.enable` compiles, each on its own
      (torchtitan's per-block torch.compile: the blocks repeat, so one graph serves them
      all, and FSDP2's per-block units stay outside it); None when the family is not
      compiled (GPN: its sequence engine runs its own kernels), which refuses the key.
    - `compile_fullgraph`: whether each block compiles as one graph (torch.compile's
      fullgraph=True, an error on any graph break) or may break around what dynamo cannot
      trace.
    - `not_compiled`: why a family with no `compile_blocks` is not compiled, the end of the
      one line that refuses `compile.enable` ("model=... is family X, <not_compiled>").

    What the rest of the package asks a family instead of comparing its name
    (docs/families.md, "Adding a family"):

    - `title`: its name in prose ("GPN", "Transformer++"), in the lines that name the
      families taking an option; empty = `name`.
    - `run_options`: the family-specific training options it accepts, each a function
      `(config, the run's value) -> config`: "tbptt" (`train.tbptt`, an int) and "engine"
      (the run's `engine:` section, the keys it sets). Any other family refuses the option in
      one line naming the families that take it (gpn_scale/run/model.py).
    - `hf_adapter`: loads the module that maps the family onto a Hugging Face architecture
      (`llama_config`, `to_llama`, `from_llama`, `start_token_id`: `gpn-scale export --format
      hf`); None = the family exports as safetensors only, and `--format hf` is one line.
    - `info`: the rows `gpn-scale info` prints, `(cfg, name, batch_size, seq_len) -> [(key,
      value)]`; None = the rows every spec can give (gpn_scale/models/commands.py).
    - `depth_is_variant`: a config's depth (n_layers > 1) is part of its family label, a
      curve of its own in sweeps and fits ("gpn+m-2l"; gpn_scale/scaling/families.py).
    - `launch_accounting`: gpn_scale/accounting models this family's training step, so a
      sweep's `hardware.mfu: predicted` prices it.
    - `state_analyses`: `gpn-scale analyze` and the trainer's live analyses read its state
      (GPN's reference step path, single recurrent state and memory heads).
    - `for_inference`: the config a checkpoint loaded for evaluation, generation, analysis
      or export runs under (gpn_scale/eval/load.py): the exact model, without the training
      options that trade accuracy for speed (GPN: `engine.bf16_memory_reads` off).
    """

    name: str
    config_from_dict: Callable[[Mapping[str, Any]], Any]
    build: Callable[[Any], nn.Module]
    count_parameters: Callable[[Any], int]
    flops_per_token: Callable[[Any, int], float]
    fsdp_units: Callable[[nn.Module], list[nn.Module]]
    compat_keys: Callable[[Any], dict[str, Any]]
    recurrent: bool
    apply_tp: Callable[[nn.Module, Any], None] | None = None
    check_tp: Callable[[Any, int], None] = field(default=lambda cfg, tp: None)
    check_device: Callable[[Any, str], None] = field(default=lambda cfg, device_type: None)
    compile_blocks: Callable[[nn.Module], list[nn.Module]] | None = None
    compile_fullgraph: bool = True
    not_compiled: str = "which declares no blocks to compile"
    description: str = ""
    title: str = ""
    run_options: Mapping[str, Callable[[Any, Any], Any]] = field(default_factory=dict)
    hf_adapter: Callable[[], Any] | None = None
    info: Callable[[Any, str, int, int], list[tuple[str, str]]] | None = None
    depth_is_variant: bool = False
    launch_accounting: bool = False
    state_analyses: bool = False
    for_inference: Callable[[Any], Any] = field(default=lambda cfg: cfg)

    @property
    def display_name(self) -> str:
        return self.title or self.name
