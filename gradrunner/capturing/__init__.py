"""The capture layer: tap specs resolved against a model, the three strategies, device-side statistics.

Knows nothing of Hydra, Parquet or the runner (import-linter checks it).

| module | what it holds |
| --- | --- |
| `taps` | tap specs (`"<module>:<name>"`) resolved against a model, before the first step |
| `elements` | `output.N` / `output.KEY` elements of tuple, dict and dataclass values |
| `forward_locals` | local variables of a `forward()`, tapped by rewriting its source |
| `forward_patch` | a module's `forward()` calls sent to the rewritten copy, and back (`patch_forward`) |
| `owned` | `owned(module, hook)`: every module hook acts for the module it was installed on only, not a deepcopy's |
| `grad_context` | autograd state: no_grad, checkpointing, backward, models gradrunner refuses |
| `torch_compat` | every torch internal gradrunner uses, detected once, each with a public fallback |
| `strategies` | `retain_grad`, `hook`, `autograd_grad`: one file each, one registry; what happens around a backward |
| `stats` | statistics on the gradient's device, one host transfer per step |
| `edits` | gradient edits (`edits=[...]`): one edit node per firing, a hook per edited parameter |
| `edit_ops` | what each edit operation does to a gradient, and the seeds of the random ones |
| `session` | `capture(model, taps, strategy=...)`, the context manager |
| `open_sessions` | the sessions open now; none opens beside an `autograd_grad` one on the same model, nor it beside another |
| `firing` | the session's forward side: taps fire, each firing a slot the strategy attaches to |
| `backwards` | the session's backward side: each backward's begin and end (its own or the user's), the step's records |
| `params` | parameter taps, read one way: held gradient edges, or `.grad` after DDP's or FSDP2's synchronisation |
| `dtensors` | telling sharded tensors (`DTensor`: FSDP2, HSDP, TP) apart without importing DTensor's machinery |
| `sharded` | statistics of sharded tensors from local pieces, merged by placement in one SUM and one MAX all-reduce |
| `sharded_rows` | `Collector`'s sharded records of a step: reduced as they arrive, merged once in `finish` |
| `recorded_norms` | the value and edited norms a record holds, of a plain or a sharded tensor |
| `sharded_hooks` | post-accumulate-grad hooks handing each sharded parameter's gradient piece out |
| `grads` | `Grads`: the last backward's kept gradients, by tap and call |
| `per_example` | per-example norms of parameters (`PerExampleNorms`): each row's share of `.grad`, during backward |
| `per_example_layers`, `per_example_math` | the supported layers' shares, and their row norms (ghost or materialised) |
| `per_example_conv` | a convolution weight's share per row: ghost, im2col or one grouped convolution, by its shapes |
| `per_example_hfnorms` | transformers' own RMSNorm classes, recognised by bytecode: each position's term of the weight's share |
| `per_example_check` | the per-step check that a parameter's gradient is its calls' shares; the null rows' warning |

Example::

    from gradrunner.capturing import capture
    with capture(model, ["fc1:output"], strategy="hook") as cap:
        cap.backward(loss_fn(model(x), y))
"""

from gradrunner.capturing.session import Capture, Grads, capture
from gradrunner.capturing.strategies import STRATEGIES, Slot, Strategy, get_strategy
from gradrunner.capturing.taps import Tap, resolve_taps

__all__ = ["STRATEGIES", "Capture", "Grads", "Slot", "Strategy", "Tap", "capture", "get_strategy", "resolve_taps"]
