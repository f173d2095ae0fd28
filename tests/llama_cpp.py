"""llama.cpp's own source, as llama-cpp-python's source distribution ships it (DESIGN 13), and one build.

`source()` is the extracted vendor/llama.cpp folder: its converter (convert_hf_to_gguf.py with
conversion/), its gguf-py, and its vocabulary-only GGUFs (models/ggml-vocab-*.gguf, e.g. Llama-3's BPE
as ggml-vocab-llama-bpe.gguf). Downloaded once from the package registry with pip and cached under
~/.cache/ffn-fusion (or $FFN_FUSION_CACHE's parent), under a file lock so pytest-xdist workers share it.

`build()` compiles that source once (cmake Release, shared libraries, no HTTPS client, CPU backend tuned
to this machine: 10-17 minutes on 2 cores) into `cache_dir()/build/bin`: llama-server, llama-cli,
llama-perplexity and the shared libraries. `wheel()` then packs llama-cpp-python of the same source
against that build without compiling llama.cpp again (its CMake option LLAMA_BUILD=OFF gives the Python
package alone; the build's shared libraries are added to the wheel's llama_cpp/lib, where the package
loads them from) and caches it under ~/.cache/ffn-fusion/wheels. `make llama-cpp` runs both and installs
the wheel into .venv. Tests never build: they ask `binaries()` / `llama_cpp_available()` and skip.

    .venv/bin/python -m tests.llama_cpp            # print source()
    .venv/bin/python -m tests.llama_cpp build      # build() (and print bin/)
    .venv/bin/python -m tests.llama_cpp wheel      # build() and wheel() (and print the wheel)
    .venv/bin/python -m tests.llama_cpp binaries   # print binaries(), never builds
"""

from __future__ import annotations

import base64
import functools
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

import gguf
import numpy as np
from filelock import FileLock

VERSION = "0.3.36"  # llama-cpp-python; DESIGN 13 measured this one

# What the project runs of llama.cpp: the server (tools/bench.py serve's peer), a command-line generator,
# perplexity (DESIGN 13), and the shared libraries that llama-cpp-python loads (llama, ggml*, mtmd).
TARGETS = ("llama-server", "llama-cli", "llama-perplexity", "llama", "ggml", "mtmd")
BINARIES = ("llama-server", "llama-cli", "llama-perplexity")

CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=ON",
    # This llama.cpp has no curl any more (LLAMA_CURL is deprecated and ignored); its HTTPS client
    # (model download by URL) is OpenSSL's: off. The server's web UI would be downloaded: off (empty).
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    # Libraries and programs find each other by $ORIGIN: the staged build folder is renamed when done.
    "-DCMAKE_BUILD_RPATH_USE_ORIGIN=ON",
)


def cache_dir() -> Path:
    env = os.environ.get("FFN_FUSION_CACHE")
    root = Path(env).parent if env else Path.home() / ".cache" / "ffn-fusion"
    return root / f"llama-cpp-python-{VERSION}"


def wheels_dir() -> Path:
    return cache_dir().parent / "wheels"


@functools.cache
def source() -> Path:
    """vendor/llama.cpp of llama-cpp-python VERSION, downloaded and extracted once."""
    folder = cache_dir()
    folder.parent.mkdir(parents=True, exist_ok=True)
    root = folder / "src" / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"
    with FileLock(f"{folder}.lock"):
        if not root.is_dir():
            staging = folder.with_name(folder.name + ".partial")
            shutil.rmtree(staging, ignore_errors=True)
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                 f"llama-cpp-python=={VERSION}", "-d", str(staging / "sdist")], check=True)
            (archive,) = (staging / "sdist").glob("*.tar.gz")
            with tarfile.open(archive) as tar:
                tar.extractall(staging / "src", filter="data")
            shutil.rmtree(folder, ignore_errors=True)
            staging.rename(folder)
    return root


def _build_dir() -> Path:
    return cache_dir() / "build"


def _complete(build: Path) -> bool:
    return (build / "ffn-fusion-build.json").is_file()


def binaries() -> Path | None:
    """The built bin/ folder (llama-server, llama-cli, llama-perplexity, lib*.so), or None: never builds."""
    build = _build_dir()
    return build / "bin" if _complete(build) else None


def llama_server() -> Path | None:
    """The built llama-server, or None when `make llama-cpp` has not run."""
    folder = binaries()
    return folder / "llama-server" if folder else None


def llama_cpp_available() -> bool:
    """Whether `import llama_cpp` (the Python package) would work; does not import it."""
    return importlib.util.find_spec("llama_cpp") is not None


def _nice() -> None:
    os.nice(10)


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def build(jobs: int = 2, log=_stderr) -> Path:
    """Compile llama.cpp once (TARGETS) and return its bin/ folder; a second call returns the first build.

    Staged in build.partial (kept on failure, so a rerun continues where it stopped) and renamed to
    build/ with a record file only when every target is built: a half build never counts.
    """
    build_dir = _build_dir()
    cache_dir().mkdir(parents=True, exist_ok=True)
    with FileLock(f"{build_dir}.lock"):
        if _complete(build_dir):
            return build_dir / "bin"
        src = source()
        staging = build_dir.with_name("build.partial")
        generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        if generator and (staging / "CMakeCache.txt").is_file() and not (staging / "build.ninja").is_file():
            shutil.rmtree(staging)  # a partial build of another generator
        start = time.perf_counter()
        configure = ["cmake", "-S", str(src), "-B", str(staging), *generator, *CMAKE_OPTIONS]
        log(f"llama.cpp: configuring in {staging}")
        subprocess.run(configure, check=True, preexec_fn=_nice, stdout=sys.stderr)
        log(f"llama.cpp: building {', '.join(TARGETS)} with -j{jobs} (10-17 minutes on 2 cores)")
        subprocess.run(["cmake", "--build", str(staging), "-j", str(jobs), "--target", *TARGETS],
                       check=True, preexec_fn=_nice, stdout=sys.stderr)
        missing = [name for name in BINARIES if not (staging / "bin" / name).is_file()]
        if missing:
            raise RuntimeError(f"llama.cpp build finished without {missing} in {staging / 'bin'}")
        seconds = time.perf_counter() - start
        record = {"version": VERSION, "seconds": round(seconds, 1), "jobs": jobs, "cmake": configure,
                  "targets": list(TARGETS), "built": time.strftime("%Y-%m-%dT%H:%M:%S")}
        (staging / "ffn-fusion-build.json").write_text(json.dumps(record, indent=1) + "\n")
        shutil.rmtree(build_dir, ignore_errors=True)
        staging.rename(build_dir)
        log(f"llama.cpp: built in {seconds / 60:.1f} minutes: {build_dir / 'bin'}")
    return build_dir / "bin"


# The libraries llama-cpp-python loads (llama_cpp.py, _ggml.py, mtmd_cpp.py) and what they need.
WHEEL_LIBRARIES = ("llama", "ggml", "ggml-base", "ggml-cpu", "mtmd")


def _shared_libraries(folder: Path) -> list[Path]:
    """The build's libraries for the wheel, each under two names: `libX.so`, which llama-cpp-python opens
    with ctypes, and its soname `libX.so.0`, by which the others ask for it (their RUNPATH is $ORIGIN).
    Wheels hold no symbolic links: both are copies."""
    names = [f"lib{name}.so{suffix}" for name in WHEEL_LIBRARIES for suffix in ("", ".0")]
    missing = [name for name in names if not (folder / name).is_file()]
    if missing:
        raise RuntimeError(f"{folder} lacks {missing}")
    return [folder / name for name in names]


def wheel(log=_stderr) -> Path:
    """llama-cpp-python VERSION as a wheel holding the build()'s libraries; built once, cached."""
    wheels = wheels_dir()
    wheels.mkdir(parents=True, exist_ok=True)
    name = f"llama_cpp_python-{VERSION}-py3-none-linux_x86_64.whl"  # scikit-build-core's py-api py3 name
    with FileLock(f"{wheels / name}.lock"):
        found = sorted(wheels.glob(f"llama_cpp_python-{VERSION}-*.whl"))
        if found:
            return found[0]
        folder = build(log=log)
        package = source().parent.parent  # llama_cpp_python-VERSION, the source distribution's root
        staging = wheels / f"llama_cpp_python-{VERSION}.partial"
        shutil.rmtree(staging, ignore_errors=True)
        log("llama-cpp-python: packing the wheel without llama.cpp (LLAMA_BUILD=OFF)")
        env = dict(os.environ, CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF")
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                        "-w", str(staging / "bare"), str(package)], check=True, env=env, stdout=sys.stderr)
        (bare,) = (staging / "bare").glob("*.whl")
        _add_libraries(bare, _shared_libraries(folder), staging / bare.name)
        (staging / bare.name).rename(wheels / bare.name)
        shutil.rmtree(staging)
        return wheels / bare.name


def _add_libraries(bare: Path, libraries: list[Path], out: Path) -> None:
    """Copy `bare` with `libraries` added under llama_cpp/lib/ (files, symlinks resolved) and its RECORD
    rewritten for them."""
    def digest(data: bytes) -> str:
        return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()

    with zipfile.ZipFile(bare) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        (record_name,) = [n for n in src.namelist() if n.endswith(".dist-info/RECORD")]
        record = [line for line in src.read(record_name).decode().splitlines() if line]
        for item in src.infolist():
            if item.filename != record_name:
                dst.writestr(item, src.read(item))
        for lib in libraries:
            data = lib.read_bytes()
            arcname = f"llama_cpp/lib/{lib.name}"
            info = zipfile.ZipInfo(arcname, date_time=(2020, 1, 1, 0, 0, 0))
            info.external_attr = 0o755 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            dst.writestr(info, data)
            record.insert(-1, f"{arcname},{digest(data)},{len(data)}")
        dst.writestr(record_name, "\n".join(record) + "\n")


def tiny_gguf(path: Path, seed: int = 0, vocab_file: str = "ggml-vocab-gpt-2.gguf") -> Path:
    """A random tiny Llama (2 layers, hidden 32, 4 heads, 2 KV heads, FFN 64, tied output) as an f32 GGUF
    with the tokenizer of llama.cpp's vocabulary-only `vocab_file` (GPT-2's by default): a model llama-server
    and llama-cpp-python load in a fraction of a second, for tests of the serving path, not of numbers."""
    vocab = gguf.GGUFReader(source() / "models" / vocab_file)
    tokens = vocab.fields["tokenizer.ggml.tokens"].contents()
    rng = np.random.default_rng(seed)
    hidden, heads, kv_heads, ffn, layers = 32, 4, 2, 64, 2
    head_dim = hidden // heads

    def weight(*shape: int, scale: float = 0.2) -> np.ndarray:
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny llama (tests)")
    writer.add_block_count(layers)
    writer.add_context_length(2048)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(len(tokens))
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model(vocab.fields["tokenizer.ggml.model"].contents())
    writer.add_tokenizer_pre(vocab.fields["tokenizer.ggml.pre"].contents())
    writer.add_token_list(tokens)
    writer.add_token_types(vocab.fields["tokenizer.ggml.token_type"].contents())
    writer.add_token_merges(vocab.fields["tokenizer.ggml.merges"].contents())
    writer.add_bos_token_id(vocab.fields["tokenizer.ggml.bos_token_id"].contents())
    writer.add_eos_token_id(vocab.fields["tokenizer.ggml.eos_token_id"].contents())
    writer.add_add_bos_token(False)
    writer.add_tensor("token_embd.weight", weight(len(tokens), hidden))
    writer.add_tensor("output_norm.weight", 1 + weight(hidden, scale=0.1))
    for i in range(layers):
        for name, shape in [("attn_norm", (hidden,)), ("ffn_norm", (hidden,))]:
            writer.add_tensor(f"blk.{i}.{name}.weight", 1 + weight(*shape, scale=0.1))
        kv = kv_heads * head_dim
        shapes = {"attn_q": (hidden, hidden), "attn_k": (kv, hidden), "attn_v": (kv, hidden),
                  "attn_output": (hidden, hidden), "ffn_gate": (ffn, hidden), "ffn_up": (ffn, hidden),
                  "ffn_down": (hidden, ffn)}
        for name, shape in shapes.items():
            writer.add_tensor(f"blk.{i}.{name}.weight", weight(*shape))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def converter_python() -> Path | None:
    """A Python with the transformers the converter pins (requirements-convert_hf_to_gguf.txt:
    transformers==4.57.6): the Optimum venv's (tests/corpora/third_party.py; `make optimum-venv`), or None
    when it is not there. The converter reads a vocabulary with AutoTokenizer, which under this project's
    transformers 5 cannot open a nemotron-nas folder (it loads the DeciLM config without its remote code
    and fails with "'PreTrainedConfig' object has no attribute 'max_position_embeddings'")."""
    from tests.corpora.third_party import optimum_python  # noqa: PLC0415 (imports onnx-ir and ORT's optimizer)

    python = optimum_python()
    return python if python.is_file() else None


def convert_hf(folder: Path, output: Path, outtype: str = "f32", python: Path | None = None) -> Path:
    """llama.cpp's own converter (convert_hf_to_gguf.py of source(), with its own gguf-py) on a Hugging Face
    folder, run by `python` (default: this one): `outtype` f32, f16, bf16 or q8_0. Raises
    CalledProcessError (its output in `.stderr`) when the converter refuses the folder.

    Its Llama class imports `sentencepiece` before looking for tokenizer.model; where the package is
    missing (it is no dependency here) a stand-in makes the import pass, and the converter goes on to the
    tokenizer.json the folder has (the stand-in is never called: there is no tokenizer.model to load)."""
    python = Path(python or sys.executable)
    paths = [str(source() / "gguf-py")]
    probe = subprocess.run([str(python), "-c", "import sentencepiece"], capture_output=True)
    if probe.returncode != 0:
        shim = cache_dir() / "sentencepiece-stand-in"
        (shim / "sentencepiece").mkdir(parents=True, exist_ok=True)
        (shim / "sentencepiece" / "__init__.py").write_text(
            "class SentencePieceProcessor:  # tests/llama_cpp.convert_hf: the folder has no tokenizer.model\n"
            "    def __init__(self, *args, **kwargs):\n"
            "        raise ImportError('sentencepiece is not installed')\n")
        paths.append(str(shim))
    if os.environ.get("PYTHONPATH"):
        paths.append(os.environ["PYTHONPATH"])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
    command = [str(python), str(source() / "convert_hf_to_gguf.py"), str(folder), "--outtype", outtype,
               "--outfile", str(output)]
    subprocess.run(command, check=True, env=env, capture_output=True, text=True)
    return output


if __name__ == "__main__":
    command = sys.argv[1] if len(sys.argv) > 1 else "source"
    if command == "build":
        print(build())
    elif command == "wheel":
        print(wheel())
    elif command == "binaries":
        print(binaries() or "not built (make llama-cpp)")
    else:
        print(source())
