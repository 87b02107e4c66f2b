"""s2s: train and run encoder-decoder transformers for translation and summarization.

The library API the CLI is built on:

    from s2s import load_config, train, load_model_dir, Translator
    cfg = load_config("recipes/quickstart.yaml")
    run_dir = train(cfg, "exp")
    translator = Translator.from_dir(run_dir)
    print(list(translator.translate_lines(["Hello world"])))
"""

__version__ = "0.1.0"

from s2s.config import ExperimentConfig, load_config  # noqa: E402
from s2s.errors import S2SError  # noqa: E402


def __getattr__(name):  # lazy: importing s2s stays cheap for `s2s --help`
    if name == "train":
        from s2s.trainer import train
        return train
    if name == "Translator":
        from s2s.translate import Translator
        return Translator
    if name == "load_model_dir":
        from s2s.modeldir import load_model_dir
        return load_model_dir
    if name == "prepare":
        from s2s.data import prepare
        return prepare
    if name == "train_tokenizer":
        from s2s.tokenizer import train_tokenizer
        return train_tokenizer
    raise AttributeError(name)


__all__ = ["ExperimentConfig", "S2SError", "load_config", "train", "Translator", "load_model_dir",
           "prepare", "train_tokenizer", "__version__"]
