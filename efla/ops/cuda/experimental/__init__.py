"""GPU-path experiments: code that may become the default once a GPU has measured it, or be deleted.

* ``split_state``: the state passes over sequences cut into pieces that walk side by side
  (``EFLA_SPLIT_STATE=<pieces>``);
* ``tuning``: fla's state-pass kernels tuned per bucket of sequences x heads
  (``EFLA_STATE_TUNING=1``);
* ``fused_forward``: the chunk forward's state and output passes as one kernel
  (``EFLA_FUSED_FORWARD=1``).

The rule for what sits here: each module is switched off by default and has no measured win at
every benchmark shape. The default code path never imports this package: the call sites in
``efla.ops.cuda`` import a module lazily, only when ``efla.environment`` says its switch is on
(``tests/ops/test_experimental.py`` checks it). Each module's docstring says what a GPU has and
has not shown, and the one command that decides it at the next GPU visit. An experiment leaves
this package as the default, with a dispatch rule measured on a GPU, or is deleted.

``EFLA_FUSED_FORWARD`` and ``EFLA_SPLIT_STATE`` together are refused: the fused forward has no state
pass to split, while the backward's would still be split.
"""
