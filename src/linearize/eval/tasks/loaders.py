"""What the ``!function loaders.X`` entries of this folder's YAML files resolve to (lm-eval imports
this file by its path). The code lives in ``linearize.eval.lm_eval_tasks``."""

from linearize.eval.lm_eval_tasks import (  # noqa: F401
    load_arc_challenge,
    load_arc_easy,
    load_hellaswag,
    load_mmlu,
    load_piqa,
    load_winogrande,
    winogrande_contexts,
    winogrande_continuation,
    winogrande_gold_index,
)
