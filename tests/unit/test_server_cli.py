"""`peagle serve`: options and the speculative config (flag or environment) reach the engine and the app."""

from __future__ import annotations

import json
import logging
import shutil
import socket

import pytest
import uvicorn
from fastapi.testclient import TestClient
from server_fixtures import make_head

from peagle.cli import main
from peagle.server import cli as server_cli, launcher


@pytest.fixture(scope="module")
def target_dir(tiny_hf_checkpoint):
    return tiny_hf_checkpoint("llama", num_layers=4)


@pytest.fixture(scope="module")
def head(target_dir, tmp_path_factory):
    return make_head(target_dir, "peagle", tmp_path_factory.mktemp("peagle") / "head")


@pytest.fixture
def served(monkeypatch):
    """Captures what `peagle serve` would run instead of starting a server."""
    runs, bound = [], {}

    def bind(host, port):
        bound.update(host=host, port=port)
        return socket.create_server(("127.0.0.1", 0))

    def run(server, sockets=None):
        c = server.config
        runs.append((c.app, {**bound, "root_path": c.root_path, "log_level": c.log_level, "access_log": c.access_log,
                             "ssl_keyfile": c.ssl_keyfile, "ssl_certfile": c.ssl_certfile}))

    monkeypatch.setattr(uvicorn.Server, "run", run)
    monkeypatch.setattr(launcher, "bind_socket", bind)
    register = server_cli.register

    def in_process(subparsers):  # the engine thread: these tests read the app's engine and start no process
        p = register(subparsers)
        p.set_defaults(engine_thread=True)
        return p

    monkeypatch.setattr(server_cli, "register", in_process)
    for var in ("PEAGLE_SPECULATIVE_CONFIG", "SM_VLLM_SPECULATIVE_CONFIG", "PEAGLE_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    return runs


def _argv(target_dir, *extra):
    return ["serve", str(target_dir), "--device", "cpu", "--dtype", "fp32", "--max-model-len", "128",
            "--num-kv-blocks", "32", *extra]


def test_help_explains_every_option(capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for option in ("--speculative-config", "--host", "--port", "--api-key", "--served-model-name", "--max-model-len",
                   "--max-num-seqs", "--max-queue", "--gpu-memory-utilization", "--dtype", "--device",
                   "--enforce-eager", "--num-kv-blocks", "--chat-template", "--enable-prefix-caching", "--trust-request-chat-template", "SM_VLLM_SPECULATIVE_CONFIG", "PEAGLE_SPECULATIVE_CONFIG",
                   "--config", "--tokenizer", "--load-format", "--allowed-origins", "--allowed-methods", "--allowed-headers", "--allow-credentials",
                   "--root-path", "--ssl-keyfile", "--ssl-certfile", "--uvicorn-log-level",
                   "--disable-uvicorn-access-log", "--disable-log-stats", "--enable-request-id-headers",
                   "--reasoning-parser", "--tensor-parallel-size", "--pipeline-parallel-size", "--trust-remote-code",
                   "--tool-call-parser", "--enable-auto-tool-choice", "--enable-log-requests", "--disable-log-requests",
                   "--max-log-len", "--kv-cache-dtype", "--block-size", "--stream-interval", "--engine-thread",
                   "--api-server-count", "--shutdown-timeout", "--max-request-bytes", "--synthetic-acceptance"):
        assert option in text


def test_sagemaker_style_environment_config(target_dir, head, served, monkeypatch):
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 2, "parallel_drafting": True}
    monkeypatch.setenv("SM_VLLM_SPECULATIVE_CONFIG", json.dumps(spec))
    monkeypatch.setenv("PEAGLE_API_KEY", "secret")
    argv = _argv(target_dir, "--served-model-name", "tiny", "--max-num-seqs", "3", "--max-queue", "5",
                 "--host", "127.0.0.1", "--port", "8123")
    assert main(argv) == 0
    (app, kw), = served
    assert (kw["host"], kw["port"]) == ("127.0.0.1", 8123)
    engine = app.state.async_engine.engine
    assert engine.k == 2 and engine.spec.parallel_drafting is True and engine.max_model_len == 128
    assert app.state.serving.model_name == "tiny" and app.state.serving.max_in_flight == 3 + 5
    client = TestClient(app)  # no lifespan: the engine loop is not needed to check the key
    assert client.get("/v1/models").status_code == 401
    assert client.post("/invocations", json={"prompt": "x"}).status_code == 401  # the key covers it as /v1
    assert client.get("/ping").status_code == 503  # a probe, open without the key (no engine loop without lifespan)
    assert client.get("/v1/models", headers={"Authorization": "Bearer secret"}).json()["data"][0]["id"] == "tiny"


def test_flag_overrides_environment_and_bad_json_is_a_clean_error(target_dir, head, served, monkeypatch, capsys):
    monkeypatch.setenv("PEAGLE_SPECULATIVE_CONFIG", "{not json")
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 1}
    assert main(_argv(target_dir, "--speculative-config", json.dumps(spec))) == 0
    (app, _), = served
    assert app.state.async_engine.engine.k == 1
    assert app.state.serving.model_name == str(target_dir)
    assert main(_argv(target_dir)) == 1
    assert "speculative config is not valid JSON" in capsys.readouterr().err


def test_chat_template_replaces_the_models_and_a_bad_one_stops_start_up(target_dir, served, tmp_path, capsys):
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    (tmp_path / "t.jinja").write_text(template)
    assert main(_argv(target_dir, "--chat-template", str(tmp_path / "t.jinja"))) == 0
    (app, _), = served
    serving = app.state.serving
    ids = serving.render_chat([{"role": "user", "content": "Hi"}], True, False)
    assert ids == serving.tokenizer.encode("<user>Hi")
    assert main(_argv(target_dir, "--chat-template", str(tmp_path / "nope.jinja"))) == 1
    assert "no such file, and not a template" in capsys.readouterr().err
    assert len(served) == 1  # refused before a server started


def test_enable_prefix_caching_reaches_the_engine(target_dir, served):
    assert main(_argv(target_dir, "--enable-prefix-caching")) == 0
    assert main(_argv(target_dir)) == 0
    (on, _), (off, _) = served
    assert on.state.async_engine.engine.scheduler.block_manager.enable_prefix_caching is True
    assert off.state.async_engine.engine.scheduler.block_manager.enable_prefix_caching is False


def test_draft_confidence_cutoff_reaches_the_engine_and_a_bad_one_stops_start_up(target_dir, head, served, capsys):
    spec = json.dumps({"method": "eagle3", "model": str(head), "num_speculative_tokens": 3})
    assert main(_argv(target_dir, "--speculative-config", spec, "--draft-confidence-cutoff", "0.25")) == 0
    engine = served[0][0].state.async_engine.engine
    assert engine.config.draft_confidence_cutoff == 0.25 and engine.planner.cutoff(8) == 0.25
    assert main(_argv(target_dir, "--speculative-config", spec, "--draft-confidence-cutoff", "1.5")) != 0
    assert "draft_confidence_cutoff must be a number in [0, 1]" in capsys.readouterr().err
    assert len(served) == 1


def test_chat_template_kwargs_reach_the_template(target_dir, served):
    template = ("{% if enable_thinking is defined and not enable_thinking %}/no_think {% endif %}"
                "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert main(_argv(target_dir, "--chat-template", template)) == 0
    (app, _), = served
    client = TestClient(app)  # /tokenize renders without the engine loop
    tok = app.state.serving.tokenizer
    body = {"messages": [{"role": "user", "content": "Hi"}]}
    plain = client.post("/tokenize", json=body).json()["tokens"]
    off = client.post("/tokenize", json={**body, "chat_template_kwargs": {"enable_thinking": False}}).json()["tokens"]
    assert plain == tok.encode("Hi", add_special_tokens=False) and off == tok.encode("/no_think Hi",
                                                                                     add_special_tokens=False)
    bad = client.post("/tokenize", json={**body, "chat_template_kwargs": {"messages": []}})
    assert bad.status_code == 400 and "chat_template_kwargs" in bad.json()["error"]["message"]
    chat = client.post("/v1/chat/completions", json={**body, "chat_template_kwargs": {"tools": []}})
    assert chat.status_code == 400 and "tools are set by the request's own fields" in chat.json()["error"]["message"]


def test_continue_final_message_leaves_the_last_message_open(target_dir, served):
    assert main(_argv(target_dir)) == 0
    (app, _), = served
    client, tok = TestClient(app), app.state.serving.tokenizer
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, I am"}]
    body = {"messages": messages, "add_generation_prompt": False, "continue_final_message": True}
    got = client.post("/tokenize", json=body).json()["tokens"]
    assert got == tok.encode_chat(messages, add_generation_prompt=False, continue_final_message=True)
    assert tok.decode(got).endswith("Hello, I am")
    both = client.post("/v1/chat/completions", json={**body, "add_generation_prompt": True})
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"


def test_a_requests_chat_template_needs_the_trust_flag(target_dir, served):
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    body = {"messages": [{"role": "user", "content": "Hi"}], "chat_template": template}
    assert main(_argv(target_dir)) == 0
    assert main(_argv(target_dir, "--trust-request-chat-template")) == 0
    (untrusted, _), (trusted, _) = served
    refused = TestClient(untrusted).post("/tokenize", json=body)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template"
    assert "--trust-request-chat-template" in refused.json()["error"]["message"]
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    with_tools = TestClient(untrusted).post("/v1/chat/completions", json={**body, "tools": [tool]})
    assert with_tools.json()["error"]["param"] == "chat_template"  # the refusal comes before the template is read
    tok = trusted.state.serving.tokenizer
    assert TestClient(trusted).post("/tokenize", json=body).json()["tokens"] == tok.encode("<user>Hi",
                                                                                          add_special_tokens=False)
    assert tok.chat_template != template  # the server's own template is untouched


def test_generation_config_fills_what_a_request_leaves_out(target_dir, served, tmp_path, capsys):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(target_dir, model)
    config = json.loads((model / "generation_config.json").read_text())
    config.update({"temperature": 0.6, "top_p": 0.95, "top_k": 50, "max_new_tokens": 7})  # top_k 50: transformers'
    (model / "generation_config.json").write_text(json.dumps(config))
    assert main(_argv(model)) == 0
    assert main(_argv(model, "--generation-config", "vllm")) == 0
    (auto, _), (plain, _) = served
    serving = auto.state.serving
    assert serving.sampling_defaults == {"temperature": 0.6, "top_p": 0.95, "max_tokens": 7}
    assert plain.state.serving.sampling_defaults == {}
    from peagle.server.protocol import ChatCompletionRequest

    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "Hi"}], "top_p": 0.5})
    filled = serving._with_defaults(req)
    assert (filled.temperature, filled.top_p) == (0.6, 0.5)  # the request's own value wins
    params = serving._sampling_params(filled, 7)
    assert (params.temperature, params.top_p, params.max_tokens) == (0.6, 0.5, 7)
    config["temperature"] = -1.0
    (model / "generation_config.json").write_text(json.dumps(config))
    capsys.readouterr()
    assert main(_argv(model)) == 1
    assert "generation_config.json: its sampling defaults are not valid" in capsys.readouterr().err
    assert main(_argv(model, "--generation-config", str(tmp_path / "nowhere"))) == 1
    assert "no generation_config.json there" in capsys.readouterr().err


def test_cors_as_vllm_sets_it_up(target_dir, served):
    # vLLM's defaults: any origin, method and header; --allowed-origins narrows it.
    preflight = {"Origin": "http://ui.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "content-type"}
    assert main(_argv(target_dir)) == 0
    assert main(_argv(target_dir, "--allowed-origins", '["http://other.example"]', "--allow-credentials")) == 0
    (default, _), (narrow, _) = served
    ok = TestClient(default).options("/v1/chat/completions", headers=preflight)
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "*"
    refused = TestClient(narrow).options("/v1/chat/completions", headers=preflight)
    assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers
    allowed = TestClient(narrow).options("/v1/chat/completions",
                                         headers={**preflight, "Origin": "http://other.example"})
    assert allowed.headers["access-control-allow-origin"] == "http://other.example"
    assert allowed.headers["access-control-allow-credentials"] == "true"


def test_http_options_reach_uvicorn_and_bad_ones_stop_start_up(target_dir, served, tmp_path, capsys):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    key.write_text("k")
    cert.write_text("c")
    assert main(_argv(target_dir, "--root-path", "/llm", "--uvicorn-log-level", "warning",
                      "--disable-uvicorn-access-log", "--ssl-keyfile", str(key), "--ssl-certfile", str(cert))) == 0
    (_, kw), = served
    assert (kw["root_path"], kw["log_level"], kw["access_log"]) == ("/llm", "warning", False)
    assert (kw["ssl_keyfile"], kw["ssl_certfile"]) == (str(key), str(cert))
    assert main(_argv(target_dir, "--ssl-keyfile", str(key))) == 1
    assert "--ssl-keyfile and --ssl-certfile go together" in capsys.readouterr().err
    assert main(_argv(target_dir, "--ssl-keyfile", str(key), "--ssl-certfile", str(tmp_path / "nope.pem"))) == 1
    assert "--ssl-certfile: no such file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(_argv(target_dir, "--allowed-origins", "*"))
    assert "expected a JSON list of strings" in capsys.readouterr().err
    assert len(served) == 1  # none of the refused ones started a server


def test_load_format_dummy_serves_random_weights(target_dir, served):
    spec = {"method": "eagle3", "model": "dummy", "num_speculative_tokens": 2, "parallel_drafting": True}
    assert main(_argv(target_dir, "--load-format", "dummy", "--speculative-config", json.dumps(spec))) == 0
    (app, _), = served
    engine = app.state.async_engine.engine
    assert engine.config.load_format == "dummy" and engine.k == 2


def test_synthetic_acceptance_reaches_the_engine_only_on_random_weights(target_dir, head, served, capsys):
    spec = {"method": "eagle3", "model": "dummy", "num_speculative_tokens": 2, "parallel_drafting": True}
    assert main(_argv(target_dir, "--load-format", "dummy", "--speculative-config", json.dumps(spec),
                      "--synthetic-acceptance", "0.6,0.3")) == 0
    (app, _), = served
    assert app.state.async_engine.engine.config.synthetic_acceptance == (0.6, 0.3)
    real = json.dumps({"method": "eagle3", "model": str(head), "num_speculative_tokens": 2})
    assert main(_argv(target_dir, "--speculative-config", real, "--synthetic-acceptance", "0.6,0.3")) != 0
    assert "needs load_format='dummy'" in capsys.readouterr().err
    assert main(_argv(target_dir, "--load-format", "dummy", "--speculative-config", json.dumps(spec),
                      "--synthetic-acceptance", "0.6")) != 0
    assert "one rate per draft position (2)" in capsys.readouterr().err
    assert len(served) == 1


def test_tokenizer_from_another_directory_renders_and_stops(target_dir, served, tmp_path):
    # A model directory with only its config (random weights) and EOS id 5; the tokenizer from another directory:
    # chat renders with that tokenizer, and requests stop at its EOS tokens and at the model config's.
    from peagle import LLM

    config = json.loads((target_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "eos_token_id": 5}))
    argv = ["serve", str(tmp_path), "--device", "cpu", "--dtype", "fp32", "--max-model-len", "64", "--num-kv-blocks",
            "16", "--load-format", "dummy", "--tokenizer", str(target_dir)]
    assert main(argv) == 0
    (app, _), = served
    engine, tok = app.state.async_engine.engine, app.state.serving.tokenizer
    own_eos = set(tok.eos_token_ids)
    assert own_eos and engine.eos_token_ids == own_eos | {5}
    body = {"messages": [{"role": "user", "content": "Hi"}]}
    assert TestClient(app).post("/tokenize", json=body).json()["tokens"] == tok.encode_chat(body["messages"])
    llm = LLM(model=str(tmp_path), tokenizer=str(target_dir), load_format="dummy", device="cpu", dtype="float32",
              max_model_len=64, num_kv_blocks=16)
    assert llm.engine.eos_token_ids == own_eos | {5}


def test_config_file_as_vllm_reads_it(target_dir, head, served, tmp_path, capsys):
    # Keys with dashes or underscores, switches, a JSON option given as a YAML object, the model itself; the command
    # line wins over the file.
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 2, "parallel_drafting": True}
    config = tmp_path / "serve.yaml"
    config.write_text(f"""
model: {target_dir}
device: cpu
dtype: fp32
max_model_len: 128
num-kv-blocks: 32
served-model-name: from-file
port: 8111
enable_prefix_caching: true
async-scheduling: false
speculative_config: {json.dumps(spec)}
allowed-origins: ["http://ui.example"]
""")
    assert main(["serve", "--config", str(config)]) == 0
    assert main(["--log-level", "warning", "serve", "--config", str(config), "--port", "8222",
                 "--served-model-name", "from-cli", "--enable-prefix-caching", "--no-enable-prefix-caching"]) == 0
    (a, kw_a), (b, kw_b) = served
    engine = a.state.async_engine.engine
    assert a.state.serving.model_name == "from-file" and kw_a["port"] == 8111
    assert engine.k == 2 and engine.spec.parallel_drafting and engine.max_model_len == 128
    assert engine.config.async_scheduling is False and engine.scheduler.block_manager.enable_prefix_caching
    assert b.state.serving.model_name == "from-cli" and kw_b["port"] == 8222
    assert not b.state.async_engine.engine.scheduler.block_manager.enable_prefix_caching
    # a bad file is refused naming the key, before anything starts
    for text, message in (("no-such-option: 1", "unknown option 'no-such-option'"),
                          ("enable-prefix-caching: 3", "enable-prefix-caching is a switch"),
                          ("- a\n- b", "expected a mapping"), ("port: [1", "is not valid YAML")):
        config.write_text(text)
        assert main(["serve", str(target_dir), "--config", str(config)]) == 1
        assert message in capsys.readouterr().err
    assert main(["serve", "--config", str(tmp_path / "missing.yaml")]) == 1
    assert "cannot read" in capsys.readouterr().err
    config.write_text("port: 8000")
    assert main(["serve", "--config", str(config), "--device", "cpu"]) == 1
    assert "MODEL_DIR is missing" in capsys.readouterr().err
    assert len(served) == 2
    config.write_text(f"model: {tmp_path / 'not-a-model'}\nport: 8333")  # the command line's MODEL_DIR wins
    assert main(_argv(target_dir, "--config", str(config))) == 0
    assert served[-1][1]["port"] == 8333 and served[-1][0].state.serving.model_name == str(target_dir)


def test_stats_lines_by_default_as_vllm(target_dir, served):
    assert main(_argv(target_dir)) == 0
    assert main(_argv(target_dir, "--disable-log-stats", "--enable-request-id-headers")) == 0
    (on, _), (off, _) = served
    assert on.state.async_engine.stat_logger.interval_s == 10.0
    assert off.state.async_engine.stat_logger is None
    assert "x-request-id" not in TestClient(on).get("/version").headers
    assert TestClient(off).get("/version", headers={"X-Request-Id": "r1"}).headers["x-request-id"] == "r1"


def test_several_served_model_names(target_dir, served, tmp_path, capsys):
    # As vLLM: requests may name any of them, responses and the stats carry the first; /v1/models lists all.
    assert main(_argv(target_dir, "--served-model-name", "main", "alias")) == 0
    config = tmp_path / "serve.yaml"
    config.write_text(f"model: {target_dir}\nserved-model-name: [from-file, second]\ndevice: cpu\ndtype: fp32\n"
                      "max-model-len: 128\nnum-kv-blocks: 32\n")
    assert main(["serve", "--config", str(config)]) == 0
    (app, _), (from_file, _) = served
    assert from_file.state.serving.model_names == ("from-file", "second")
    client = TestClient(app)
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["main", "alias"]
    assert client.get("/v1/models/alias").json()["id"] == "alias"
    body = {"model": "alias", "prompt": [5, 6, 7], "max_tokens": 1}
    assert client.post("/tokenize", json={"model": "alias", "prompt": "Hi"}).status_code == 200
    missing = client.post("/v1/completions", json={**body, "model": "other"})
    assert missing.status_code == 404 and "serves 'main' or 'alias'" in missing.json()["error"]["message"]
    # names before MODEL_DIR: argparse gives it to the names; the error says so
    assert main(["serve", "--device", "cpu", "--served-model-name", "a", str(target_dir)]) == 1
    assert f"--served-model-name took '{target_dir}' as a name" in capsys.readouterr().err


def test_reasoning_parser_reaches_the_app_and_a_tokenizer_without_tags_stops_start_up(target_dir, served, tmp_path,
                                                                                     capsys):
    from test_server_reasoning import rename_think_tokens

    assert main(_argv(target_dir, "--reasoning-parser", "qwen3")) == 1  # this tokenizer has no <think>
    assert "--reasoning-parser qwen3: this model's tokenizer has no '<think>' token" in capsys.readouterr().err
    assert not served  # refused before the model loaded
    think = tmp_path / "think"
    shutil.copytree(target_dir, think)
    rename_think_tokens(think)
    assert main(_argv(think, "--reasoning-parser", "deepseek_r1")) == 0
    (app, _), = served
    assert app.state.serving.reasoning[0].name == "deepseek_r1" and app.state.serving.reasoning[1] == 5
    with pytest.raises(SystemExit):
        main(_argv(think, "--reasoning-parser", "granite"))


def test_a_vllm_command_line_runs_unchanged_and_what_peagle_lacks_stops_it(target_dir, served, tmp_path, capsys,
                                                                          caplog):
    from test_server_tools import HERMES_TEMPLATE

    hermes = tmp_path / "hermes.jinja"
    hermes.write_text(HERMES_TEMPLATE)
    vllm_style = ["--tensor-parallel-size", "1", "-pp", "1", "--trust-remote-code", "--block-size", "32",
                  "--kv-cache-dtype", "auto", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                  "--chat-template", str(hermes), "--no-enable-chunked-prefill", "--enable-log-requests",
                  "--max-log-len", "4", "--stream-interval", "4"]
    assert main(_argv(target_dir, *vllm_style)) == 0
    (app, _), = served
    assert app.state.async_engine.engine.config.block_size == 32 and app.state.async_engine.stream_interval == 4
    with caplog.at_level(logging.INFO, logger="peagle.server.serving"), TestClient(app) as client:
        r = client.post("/v1/completions", json={"prompt": [7, 20, 31, 40, 50, 60], "max_tokens": 2})
        assert r.status_code == 200
    logged = [m for m in caplog.messages if m.startswith("Received request cmpl-")]
    assert len(logged) == 1 and "prompt_token_ids: [7, 20, 31, 40] (6 tokens)" in logged[0]
    assert "max_tokens=2" in logged[0]

    refused = [(["-tp", "2"], "--tensor-parallel-size 2: peagle runs on one device"),
               (["--pipeline-parallel-size", "4"], "--pipeline-parallel-size 4"),
               (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
               (["--tool-call-parser", "hermes"], "does not render tools in the Hermes"),  # the model's ChatML
               (["--enable-log-requests", "--disable-log-requests"], "contradict"),
               (["--stream-interval", "0"], "--stream-interval must be >= 1")]
    for extra, message in refused:
        assert main(_argv(target_dir, *extra)) == 1
        assert message in capsys.readouterr().err
    for extra in (["--kv-cache-dtype", "fp8"], ["--tool-call-parser", "mistral"], ["--block-size", "12"]):
        with pytest.raises(SystemExit):
            main(_argv(target_dir, *extra))
    assert len(served) == 1


def test_process_options_are_checked_before_anything_loads(target_dir, served, capsys):
    for options, message in ((["--engine-thread", "--api-server-count", "2"], "--engine-thread runs the engine inside"),
                             (["--api-server-count", "0"], "--api-server-count must be >= 1"),
                             (["--shutdown-timeout", "-1"], "--shutdown-timeout must be >= 0"),
                             (["--max-request-bytes", "0"], "--max-request-bytes must be >= 1")):
        assert main(_argv(target_dir, *options)) == 1
        assert message in capsys.readouterr().err
    assert not served


def test_the_listeners_connections_send_each_chunk_at_once():
    """The socket `peagle serve` listens on hands asyncio connections with TCP_NODELAY set: with Nagle on, a streamed
    chunk waits for the client's delayed ACK (40 ms) once a response has begun."""
    import asyncio

    listener = launcher.bind_socket("127.0.0.1", 0)
    listener.listen()
    port = listener.getsockname()[1]
    seen = []

    class Probe(asyncio.Protocol):
        def connection_made(self, transport):
            sock = transport.get_extra_info("socket")
            seen.append(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            transport.close()

    async def accept_one():
        server = await asyncio.get_running_loop().create_server(Probe, sock=listener)
        async with server:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            for _ in range(200):
                if seen:
                    break
                await asyncio.sleep(0.01)
            writer.close()

    asyncio.run(accept_one())
    assert seen and seen[0] != 0
