"""s2s: train and run encoder-decoder transformers for translation and summarization.

The library API the CLI is built on:

    import sys
    from s2s import load_config, train, load_model_dir, Translator, TranslatorPool, TranslatorSpec
    from s2s.textio import read_lines
    cfg = load_config("recipes/quickstart.yaml")
    run_dir = train(cfg, "exp")
    translator = Translator.from_dir(run_dir)
    print(list(translator.translate_lines(["Hello world"])))

    # N decoding processes, each model loaded once, for many inputs (`s2s translate --workers N`)
    with TranslatorPool(TranslatorSpec(models=(str(run_dir),)), workers=2) as pool:
        pool.translate(read_lines("input.txt"), sys.stdout)
"""

__version__ = "0.1.0"


def __getattr__(name):  # lazy: `import s2s` reads no YAML loader, no typer, no torch (see s2s.launch)
    if name in ("ExperimentConfig", "load_config"):
        from s2s import config
        return getattr(config, name)
    if name == "S2SError":
        from s2s.errors import S2SError
        return S2SError
    if name == "train":
        from s2s.trainer import train
        return train
    if name == "Translator":
        from s2s.translate import Translator
        return Translator
    if name in ("TranslatorPool", "TranslatorSpec"):
        from s2s import workers
        return getattr(workers, name)
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


__all__ = ["ExperimentConfig", "S2SError", "load_config", "train", "Translator", "TranslatorPool", "TranslatorSpec",
           "load_model_dir",
           "prepare", "train_tokenizer", "__version__"]
