import os
from pathlib import Path

import pytest

from transformer_mt.config.loading import config_from_dict, load_config
from transformer_mt.config.schema import Config, ModelConfig, TokenizerConfig, TrainConfig
from transformer_mt.core.errors import ConfigError, Problems


def problems_of(raw: dict) -> list[str]:
    with pytest.raises(ConfigError) as info:
        config_from_dict(raw)
    return info.value.problems


def test_unknown_key_suggests_the_closest_name():
    problems = problems_of({"data": {"path": "x"}, "trian": {}})
    assert problems == ["trian: unknown key (did you mean 'train'?)"]


def test_every_problem_is_listed_by_dotted_key():
    problems = problems_of({"data": {"path": "x"}, "model": {"d_model": "big", "norm": "middle"},
                            "train": {"lr": [1], "max_stpes": 10}})
    keys = sorted(p.split(":")[0] for p in problems)
    assert keys == ["model.d_model", "model.norm", "train.lr", "train.max_stpes"]
    assert any("is not one of pre, post" in p for p in problems)
    assert any("did you mean 'max_steps'" in p for p in problems)


def test_key_and_value_problems_are_listed_together_as_the_readme_shows():
    problems = problems_of({"data": {"path": "x"}, "trian": {}, "model": {"d_model": 512, "n_heads": 6}})
    assert problems == ["trian: unknown key (did you mean 'train'?)",
                        "model.n_heads: 6 does not divide model.d_model=512"]


@pytest.mark.parametrize("raw, keys", [
    # d_model keeps its default (512) when it is not a number: "5 does not divide 512" would be
    # about a value nobody wrote.
    ({"data": {"path": "x"}, "model": {"d_model": "wide", "n_heads": 5}, "train": {"lr": "fast", "warmup_steps": -1}},
     ["model.d_model", "train.lr", "train.warmup_steps"]),
    # The layer range comes from n_layers, which was not usable.
    ({"data": {"path": "x"}, "model": {"n_layers": "x"}, "train": {"attention_layer": 99}}, ["model.n_layers"]),
    ({"data": {"path": "x"}, "model": {"decoder_layers": "x"}, "train": {"attention_layer": 99}},
     ["model.decoder_layers"]),
    # A bad name or a stray key hides nothing about data.path, whose message contains "name".
    ({"name": 5, "a": 1, "data": {"path": ""}},
     ["a", "name", "data.path"]),
    # A section that is not a mapping: none of its keys is judged; the others still are.
    ({"data": {"path": "x"}, "model": 5, "decode": {"max_len_a": "x", "max_len_b": -1}},
     ["model", "decode.max_len_a", "decode.max_len_b"]),
    ({"": 1, "data": {"path": "x"}, "decode": {"beam_size": 0}}, ["", "decode.beam_size"]),
])
def test_a_key_with_a_bad_type_is_not_judged_again_by_its_default(raw, keys):
    assert [p.split(":")[0] for p in problems_of(raw)] == keys


def test_encoder_and_decoder_depths_default_to_n_layers_and_bad_ones_are_named():
    cfg = config_from_dict({"data": {"path": "x"}, "model": {"n_layers": 4}})  # a config from before the keys
    assert (cfg.model.encoder_layers, cfg.model.decoder_layers) == (None, None)  # saved as written: unset
    assert (cfg.model.n_encoder_layers, cfg.model.n_decoder_layers) == (4, 4)
    cfg = config_from_dict({"data": {"path": "x"}, "model": {"n_layers": 4, "decoder_layers": 1}})
    assert (cfg.model.n_encoder_layers, cfg.model.n_decoder_layers) == (4, 1)
    problems = problems_of({"data": {"path": "x"}, "model": {"encoder_layers": 0, "decoder_layers": -2}})
    assert problems == ["model.encoder_layers: must be at least 1 (or unset for model.n_layers), got 0",
                        "model.decoder_layers: must be at least 1 (or unset for model.n_layers), got -2"]
    problems = problems_of({"data": {"path": "x"}, "model": {"encoder_layers": "deep", "decoder_layers": 1.5}})
    assert problems == ["model.encoder_layers: expected an integer, got 'deep' (str)",
                        "model.decoder_layers: expected an integer, got 1.5 (float)"]


def test_a_resume_compares_depths_as_the_layers_they_give():
    """`n_layers: 4` and `encoder_layers: 4, decoder_layers: 4` are one model; n_layers is then unused."""
    from transformer_mt.config.schema import config_to_dict
    from transformer_mt.runs.run_dir import resume_config_changes

    saved = config_to_dict(config_from_dict({"data": {"path": "x"}, "model": {"n_layers": 4}}))
    same = {"data": {"path": "x"}, "model": {"n_layers": 0, "encoder_layers": 4, "decoder_layers": 4}}
    assert resume_config_changes(saved, config_to_dict(config_from_dict(same)), Path("config.yaml")) == []
    deeper = config_from_dict({"data": {"path": "x"}, "model": {"n_layers": 4, "encoder_layers": 6}})
    with pytest.raises(ConfigError) as caught:
        resume_config_changes(saved, config_to_dict(deeper), Path("config.yaml"))
    assert caught.value.problems[1:] == ["model.encoder_layers: 4 -> 6"]
    assert problems_of({"data": {"path": "x"}, "model": {"n_layers": 0, "encoder_layers": 4}}) == [
        "model.n_layers: must be at least 1, got 0"]  # the decoder's depth


def test_a_value_below_its_floor_is_named_once_and_an_unset_optional_key_passes():
    problems = problems_of({"data": {"path": "x", "num_proc": 0},
                            "model": {"max_len": 0}, "decode": {"batch_tokens": 4096}})
    assert problems == ["data.num_proc: must be at least 1 (or unset for automatic), got 0",
                        "model.max_len: must be at least 2 (a token and end-of-sentence), got 0"]
    cfg = config_from_dict({"data": {"path": "x", "num_proc": None}, "tokenizer": {"max_train_pairs": None}})
    assert (cfg.data.num_proc, cfg.tokenizer.max_train_pairs) == (None, None)


def test_the_attention_layer_must_be_one_of_the_decoders_layers():
    raw = {"data": {"path": "x"}, "model": {"n_layers": 6, "decoder_layers": 2}}
    assert config_from_dict({**raw, "train": {"attention_layer": -2}}).train.attention_layer == -2
    assert problems_of({**raw, "train": {"attention_layer": 2}}) == [
        "train.attention_layer: 2 is not a decoder layer (0..1, or negative to count from the last)"]


def test_lr_schedule_names_its_choices_and_the_floor_lies_between_zero_and_the_peak():
    problems = problems_of({"data": {"path": "x"}, "train": {"lr_schedule": "cosin", "min_lr": -1e-5}})
    assert problems == ["train.lr_schedule: 'cosin' (str) is not one of inverse_sqrt, linear, cosine",
                        "train.min_lr: must be at least 0, got -1e-05"]
    problems = problems_of({"data": {"path": "x"}, "train": {"lr": 1e-4, "min_lr": 1e-3}})
    assert problems == ["train.min_lr: 0.001 is above the peak train.lr=0.0001; the decay goes down to it"]
    cfg = config_from_dict({"data": {"path": "x"}, "train": {"lr_schedule": "linear", "min_lr": "1e-5"}})
    assert (cfg.train.lr_schedule, cfg.train.min_lr) == ("linear", 1e-5)
    assert config_from_dict({"data": {"path": "x"}}).train.lr_schedule == "inverse_sqrt"  # today's schedule


def test_best_metric_comet_needs_a_comet_model_to_validate_with():
    assert problems_of({"data": {"path": "x"}, "train": {"best_metric": "comet"}}) == [
        "train.best_metric: comet needs a COMET model in train.valid_comet"]
    cfg = config_from_dict({"data": {"path": "x"}, "train": {"best_metric": "comet", "valid_comet": "m/x"}})
    assert (cfg.train.best_metric, cfg.train.valid_comet) == ("comet", "m/x")


def test_a_decaying_schedule_needs_its_warmup_to_end_before_max_steps():
    """Warmup to max_steps would leave linear or cosine no decay: the rate never reaches min_lr (or
    the peak), e.g. a short fine-tune under the default warmup of 4,000 updates."""
    short = {"max_steps": 2000, "warmup_steps": 4000}
    assert problems_of({"data": {"path": "x"}, "train": {**short, "lr_schedule": "cosine"}}) == [
        "train.warmup_steps: 4000 is not below train.max_steps=2000, so train.lr_schedule=cosine would never decay "
        "(from the end of warmup to train.min_lr at max_steps); lower it"]
    assert len(problems_of({"data": {"path": "x"}, "train": {"max_steps": 10, "warmup_steps": 10,
                                                            "lr_schedule": "linear"}})) == 1
    config_from_dict({"data": {"path": "x"}, "train": short})  # inverse_sqrt: decays from wherever warmup stops
    config_from_dict({"data": {"path": "x"}, "train": {"max_steps": 10, "warmup_steps": 9, "lr_schedule": "linear"}})


def test_heads_must_divide_model_width():
    problems = problems_of({"data": {"path": "x"}, "model": {"d_model": 512, "n_heads": 6}})
    assert problems == ["model.n_heads: 6 does not divide model.d_model=512"]


def test_shared_embeddings_need_a_joint_vocabulary():
    problems = problems_of({"data": {"path": "x"}, "tokenizer": {"joint": False}, "model": {"share_embeddings": True}})
    assert [p.split(":")[0] for p in problems] == ["model.share_embeddings"]


def test_overrides_are_parsed_as_yaml_and_paths_resolve_against_the_config(tmp_path: Path):
    config_file = tmp_path / "sub" / "c.yaml"
    config_file.parent.mkdir()
    config_file.write_text("name: x\ndata:\n  path: ../corpus\ntrain:\n  lr: 0.1\n", encoding="utf-8")
    cfg = load_config(config_file, ["train.lr=3e-4", "train.betas=[0.8, 0.9]", "model.norm=post",
                                    "train.max_steps=1e3"])
    assert cfg.train.lr == 3e-4
    assert cfg.train.betas == (0.8, 0.9)
    assert cfg.model.norm == "post"
    assert cfg.train.max_steps == 1000 and isinstance(cfg.train.max_steps, int)
    assert cfg.data.path == str((tmp_path / "corpus").resolve())


def test_a_relative_data_path_given_with_set_resolves_against_the_current_directory(tmp_path: Path, monkeypatch):
    config_file = tmp_path / "configs" / "c.yaml"
    config_file.parent.mkdir()
    config_file.write_text("data:\n  path: ../in_file\n", encoding="utf-8")
    monkeypatch.chdir(tmp_path / "configs")
    assert load_config(config_file.name).data.path == str((tmp_path / "in_file").resolve())  # the file's own
    monkeypatch.chdir(tmp_path)
    assert load_config(config_file, ["data.path=corpus"]).data.path == str((tmp_path / "corpus").resolve())
    assert load_config(config_file, ["data={path: corpus}"]).data.path == str((tmp_path / "corpus").resolve())
    assert load_config(config_file, ["data.path=../in_file"]).data.path == str((tmp_path.parent / "in_file").resolve())
    assert load_config(config_file, ["train.lr=1e-3"]).data.path == str((tmp_path / "in_file").resolve())


def test_yaml_syntax_error_names_the_line(tmp_path: Path):
    config_file = tmp_path / "bad.yaml"
    config_file.write_text("name: x\ndata:\n  path: [unclosed\n", encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_config(config_file)
    assert f"{config_file}:" in str(info.value) and "YAML syntax error" in str(info.value)


def test_missing_config_file_is_named(tmp_path: Path):
    with pytest.raises(ConfigError, match="nope.yaml: config file not found"):
        load_config(tmp_path / "nope.yaml")


def test_a_key_given_twice_is_refused_with_both_lines(tmp_path: Path):
    path = tmp_path / "dup.yaml"
    path.write_text("name: x\ntrain:\n  max_steps: 3\n  lr: 0.1\nseed: 1\ntrain:\n  max_steps: 7\n")
    with pytest.raises(ConfigError, match=r"dup.yaml:6: duplicate key 'train' \(first at line 2\)"):
        load_config(path)
    # Merge keys may be overridden: that is what they are for.
    path.write_text("base: &b {max_steps: 3, lr: 0.1}\ntrain:\n  <<: *b\n  max_steps: 7\n")
    with pytest.raises(ConfigError, match="base: unknown"):  # only the anchor's home section is unknown
        load_config(path)


@pytest.mark.parametrize("content, expected", [
    (None, "is a directory, not a config file"),
    ("a: &a [*a]\n", "a YAML alias refers to the value that contains it"),
])
def test_a_config_that_is_no_file_or_contains_itself_is_a_config_error(content, expected, tmp_path: Path):
    path = tmp_path / "config.yaml"
    path.mkdir() if content is None else path.write_text(content)
    with pytest.raises(ConfigError, match=expected):
        load_config(path)


def test_demo_config_is_valid():
    from tests.helpers import DEMO_CONFIG

    cfg = load_config(DEMO_CONFIG)
    assert Path(cfg.data.path, "train.en").is_file()


def test_attention_and_activation_dropout_are_checked_like_dropout():
    problems = problems_of({"model": {"attention_dropout": 1.5, "activation_dropout": -0.1}})
    assert "model.attention_dropout: must be in [0, 1), got 1.5" in problems
    assert "model.activation_dropout: must be in [0, 1), got -0.1" in problems


def test_nan_and_infinite_numbers_are_refused_by_key(tmp_path: Path):
    config = tmp_path / "c.yaml"
    config.write_text("data: {path: x}\n", encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_config(config, ["train.lr=.nan", "decode.max_len_a=.inf", "train.betas=[0.9, -.inf]", "train.lr=nan"])
    assert sorted(info.value.problems) == ["decode.max_len_a: expected a finite number, got inf (float)",
                                           "train.betas: expected a finite number, got -inf (float)",
                                           "train.lr: expected a finite number, got 'nan' (str)"]


def test_seed_must_fit_the_random_generators():
    assert problems_of({"data": {"path": "x"}, "seed": -1}) == ["seed: must be in [0, 2**32), got -1"]
    assert problems_of({"data": {"path": "x"}, "seed": 2**40}) == [f"seed: must be in [0, 2**32), got {2**40}"]


@pytest.mark.parametrize("key, value", [("name", "a\0b"), ("name", "x" * 300), ("data.src_lang", ""),
                                        ("data.src_lang", "../en"), ("data.path", "co\0rpus")])
def test_names_that_cannot_be_file_names_are_config_errors(key, value):
    section, _, field = key.rpartition(".")
    raw = {"data": {"path": "corpus"}}
    (raw.setdefault(section, {}) if section else raw)[field] = value
    with pytest.raises(ConfigError) as caught:
        config_from_dict(raw)
    assert [problem.split(": ")[0] for problem in caught.value.problems] == [key]


def test_a_language_code_yaml_reads_as_a_boolean_says_to_quote_it():
    with pytest.raises(ConfigError, match=r"data.src_lang: expected a string, got .*False.*quote it"):
        config_from_dict({"data": {"path": "corpus", "src_lang": False}})


def test_a_section_with_every_key_commented_out_takes_the_defaults():
    assert config_from_dict({"data": {"path": "corpus"}, "train": None}).train == TrainConfig()


def test_a_hub_path_is_a_local_folder_beside_the_config_when_one_is_there(tmp_path: Path):
    (tmp_path / "sub" / "my_dataset").mkdir(parents=True)
    for path, expected in [("my_dataset", str(tmp_path / "sub" / "my_dataset")),
                           ("Helsinki-NLP/opus_books", "Helsinki-NLP/opus_books")]:
        (tmp_path / "sub" / "cfg.yaml").write_text(f"data:\n  format: hub\n  path: {path}\n")
        assert load_config(tmp_path / "sub" / "cfg.yaml").data.path == expected


def test_a_numbered_cuda_device_is_refused_with_the_way_to_pick_a_gpu():
    with pytest.raises(ConfigError, match=r"train.device: 'cuda:1' \(str\) is not one of auto, cpu, cuda, mps "
                                          r"\(to train on GPU 1, set cuda and start with CUDA_VISIBLE_DEVICES=1\)"):
        config_from_dict({"data": {"path": "corpus"}, "train": {"device": "cuda:1"}})


def test_a_data_path_under_an_unknown_users_home_is_a_path_not_an_internal_error(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text('data:\n  path: "~nosuchuser-tmt/corpus"\n', encoding="utf-8")
    cfg = load_config(config)  # Path.expanduser raises RuntimeError for an unknown user
    assert cfg.data.path == str(tmp_path / "~nosuchuser-tmt" / "corpus")


def test_a_set_value_whose_bytes_are_not_utf8_is_named_not_an_internal_error(tmp_path: Path):
    """Python hands argv bytes that are not UTF-8 over as lone surrogates, which no file or name takes."""
    config = tmp_path / "c.yaml"
    config.write_text("name: x\n", encoding="utf-8")
    with pytest.raises(ConfigError) as caught:
        load_config(config, [os.fsdecode(b"name=caf\xe9")])
    assert caught.value.problems == ["--set 'name=caf\\udce9': not valid UTF-8 (the bytes shown as \\udcXX)"]
    str(caught.value).encode("utf-8")  # the message itself can be printed


def test_setting_a_whole_section_merges_a_mapping_and_refuses_anything_else(tmp_path: Path):
    """`--set model=null` used to drop every model key of the config for the defaults, silently."""
    config = tmp_path / "c.yaml"
    config.write_text("name: x\ndata:\n  path: corpus\nmodel:\n  d_model: 128\n  d_ff: 256\n", encoding="utf-8")
    cfg = load_config(config, ["model={d_model: 64, n_heads: 4}"])
    assert (cfg.model.d_model, cfg.model.n_heads, cfg.model.d_ff) == (64, 4, 256)  # the config's d_ff kept
    for value in ("null", "3", "[1, 2]"):
        with pytest.raises(ConfigError) as caught:
            load_config(config, [f"model={value}"])
        assert caught.value.problems == [f"--set model={value}: model is a section; set its keys, "
                                         "e.g. --set model.d_model=..."]
    assert load_config(config, ["train={lr: 0.5}"]).train.lr == 0.5  # a section the config does not have


def test_a_beam_wider_than_the_vocabulary_allows_is_refused_before_training():
    raw = {"tokenizer": {"vocab_size": 100}, "decode": {"beam_size": 98}}
    with pytest.raises(ConfigError) as caught:
        config_from_dict(raw)
    assert ("decode.beam_size: 98 is more than the 97 hypotheses beam search can keep with tokenizer.vocab_size=100 "
            "(all tokens but PAD, BOS and EOS)") in caught.value.problems
    with pytest.raises(ConfigError) as caught:
        config_from_dict({**raw, "decode": {"beam_size": 97}})
    assert not [problem for problem in caught.value.problems if problem.startswith("decode.")]


def test_decode_engine_defaults_to_auto_and_names_its_choices():
    assert config_from_dict({"data": {"path": "x"}}).decode.engine == "auto"
    assert config_from_dict({"data": {"path": "x"}, "decode": {"engine": "ctranslate2"}}).decode.engine == "ctranslate2"
    assert problems_of({"data": {"path": "x"}, "decode": {"engine": "ct2"}}) == [
        "decode.engine: 'ct2' (str) is not one of auto, torch, ctranslate2"]


def test_a_section_validates_its_own_fields_against_the_rest_of_the_config():
    problems = Problems()
    ModelConfig(d_model=512, n_heads=6).validate(problems, Config(tokenizer=TokenizerConfig(joint=False)))
    assert problems.found == ["model.n_heads: 6 does not divide model.d_model=512",
                              "model.share_embeddings: true needs tokenizer.joint: true (one vocabulary for both sides)"]
    problems = Problems(defaulted=["tokenizer.joint"])  # its value was unusable: no judgement on its default
    ModelConfig().validate(problems, Config(tokenizer=TokenizerConfig(joint=False)))
    assert problems.found == []


def test_an_unknown_activation_is_refused_naming_the_choices():
    problems = problems_of({"data": {"path": "x"}, "model": {"activation": "tanh", "output_bias": "yes"}})
    assert problems[0] == "model.activation: 'tanh' (str) is not one of relu, gelu, swish"
    assert problems[1] == "model.output_bias: expected true or false, got 'yes' (str)"
