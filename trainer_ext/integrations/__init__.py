"""Where trainer_ext meets its upstream libraries' internals: `internals` is the one module that names a private
attribute or method of transformers, accelerate, DeepSpeed, torch, datasets or Optuna, or writes a public-named
attribute those libraries keep for themselves."""
