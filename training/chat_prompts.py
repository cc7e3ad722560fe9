"""Prompts a drafter's distillation data is asked with: what the target answers, so a head learns the target's
own continuations on the kinds of requests it serves (training/splits.py's groups: single-turn chats,
follow-ups, requests that repeat their input).

Three sources, each deterministic (a seed) and disjoint from every held-out or benchmark prompt
(tests/test_splits.py checks the text):
  questions  task templates x topics (explain, compare, list, advise, write ...), written for this set;
  passages   web documents of the training split (index % 20 != 0) with a request about the passage
             (summarise, rewrite, list facts, questions, explain, title), the repeat group's kind;
  follow-ups a second user turn after the target's own first answer, for a share of both.
The MT-bench training questions (question_id % 5 != 0) are answered by scripts/self_distill.py already.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from training.data import WEB_FILE, read_jsonl

TEMPLATES = (
    "Explain {t} in simple terms.",
    "What are the main advantages and disadvantages of {t}?",
    "Give me three practical tips about {t}.",
    "How would you describe {t} to a ten-year-old?",
    "Write a short paragraph about the history of {t}.",
    "What are common misconceptions about {t}?",
    "List five facts about {t}.",
    "Write a haiku about {t}.",
    "What should a beginner know before getting started with {t}?",
    "Compare {t} with {u}. Which one would you recommend and why?",
    "Why do people care about {t}?",
    "Write a short story in which {t} plays an important role.",
    "What questions would an expert ask about {t}?",
    "Summarise the most important ideas behind {t} in a few sentences.",
    "Draft a friendly email inviting a colleague to a talk about {t}.",
    "Give an example of how {t} is used in everyday life.",
    "What are the steps involved in {t}?",
    "Describe a typical day for someone whose job involves {t}.",
    "What is the difference between {t} and {u}?",
    "Write a persuasive argument for learning about {t}.",
    "What could go wrong with {t}, and how can it be avoided?",
    "Create a short quiz with three questions about {t}, with answers.",
    "Write a product review of something related to {t}.",
    "How has {t} changed over the last fifty years?",
    "Suggest a weekend project related to {t}.",
    "Write a limerick about {t}.",
    "What are the ethical questions raised by {t}?",
    "Outline a lesson plan for teaching {t}.",
    "What would the world look like without {t}?",
    "Give me a step-by-step plan to improve at {t}.",
)

TOPICS = (
    "photosynthesis", "the water cycle", "compound interest", "machine learning", "volcanoes", "the stock market",
    "recycling", "meditation", "electric cars", "the Roman Empire", "black holes", "vaccines", "gardening",
    "public transport", "chess", "climate change", "the immune system", "coffee brewing", "solar panels",
    "remote work", "social media", "the French Revolution", "bird migration", "baking bread", "cryptography",
    "plate tectonics", "jazz music", "marathon training", "renewable energy", "the printing press", "honey bees",
    "cloud computing", "budgeting", "the Moon landing", "sleep", "earthquakes", "origami", "electricity",
    "the internet", "ancient Egypt", "rainforests", "nutrition", "programming in Python", "the human heart",
    "wind turbines", "time management", "democracy", "coral reefs", "3D printing", "public speaking",
    "the Olympic Games", "hydroponics", "antibiotics", "DNA", "urban planning", "composting", "the Silk Road",
    "robotics", "photography", "learning a second language", "the ocean tides", "inflation", "bicycles",
    "classical music", "the solar system", "first aid", "volunteering", "board games", "astronomy",
    "the Renaissance", "camping", "podcasts", "video games", "nuclear power", "tea ceremonies", "penguins",
    "the theory of evolution", "credit cards", "cybersecurity", "knitting", "glaciers", "the human brain",
    "architecture", "electric guitars", "quantum computing", "mountain climbing", "libraries", "pottery",
    "the Industrial Revolution", "dinosaurs", "minimalism", "smartphones", "rivers", "chocolate", "yoga",
    "the Great Wall of China", "wildfires", "spreadsheets", "hybrid cars", "the periodic table", "sourdough",
    "bees and pollination", "weather forecasting", "online privacy", "sculpture", "running a small business",
    "carbon footprints", "mushrooms", "satellites", "the history of writing", "chemistry sets", "tides",
    "mathematics competitions", "opera", "wolves", "deserts", "coding interviews", "home insulation",
    "the metric system", "rainbows", "submarines", "folk tales", "bridges", "elephants", "paper making",
    "space stations", "maps", "fermentation", "lighthouses", "the alphabet", "magnets", "friendship",
)

PASSAGE_REQUESTS = (
    "Summarise this passage in two or three sentences:\n\n{p}",
    "Rewrite this passage so that a teenager can understand it:\n\n{p}",
    "List the key points of this passage as short bullet points:\n\n{p}",
    "Write three questions that this passage answers, each with its answer:\n\n{p}",
    "Suggest a title for this passage and explain your choice:\n\n{p}",
    "Explain the main idea of this passage and why it matters:\n\n{p}",
    "Rewrite this passage in a more formal tone:\n\n{p}",
    "Correct any errors in this passage and return the corrected version:\n\n{p}",
    "Continue this passage with one more paragraph in the same style:\n\n{p}",
    "What is the author's point of view in this passage?\n\n{p}",
)

FOLLOW_UPS = (
    "Can you give me a concrete example?",
    "Please make that shorter.",
    "Explain that again in simpler words.",
    "What is the most important point in your answer?",
    "Can you turn your answer into a numbered list?",
    "Rewrite your answer in a more formal tone.",
    "What would you add if you had more space?",
    "Now write the same thing for a child.",
    "Which part of your answer are you least sure about, and why?",
    "Give me one more idea along the same lines.",
)


@dataclass(frozen=True)
class DistillPrompt:
    id: str
    group: str  # single | repeat: what the first turn is; `follow_up` asks a second turn after the answer
    first: str
    follow_up: str | None = None


def passages(data_dir, count: int, rng: random.Random, words: tuple[int, int] = (60, 180)) -> list[str]:
    """Excerpts of `count` training-split web documents (index % 20 != 0), a whole number of words each."""
    docs = [r["text"] for i, r in enumerate(read_jsonl(data_dir / WEB_FILE)) if i % 20 != 0]
    picked = rng.sample(range(len(docs)), min(count, len(docs)))
    out = []
    for i in picked:
        w = docs[i].split()
        if len(w) < words[0]:
            continue
        n = rng.randint(*words)
        start = rng.randint(0, max(0, len(w) - n))
        out.append(" ".join(w[start: start + n]))
    return out


def distill_prompts(data_dir, questions: int = 1500, passage_tasks: int = 1000, follow_up_share: float = 0.3,
                    seed: int = 0) -> list[DistillPrompt]:
    """The distillation prompt set: `questions` template x topic requests, `passage_tasks` requests about
    training-split web passages, a `follow_up_share` of each with a follow-up turn."""
    rng = random.Random(seed)
    pairs = sorted({(i, j) for i in range(len(TEMPLATES)) for j in range(len(TOPICS))})
    rng.shuffle(pairs)
    out = []
    for n, (i, j) in enumerate(pairs[:questions]):
        other = TOPICS[(j + 1 + rng.randrange(len(TOPICS) - 1)) % len(TOPICS)]
        text = TEMPLATES[i].format(t=TOPICS[j], u=other)
        follow = FOLLOW_UPS[rng.randrange(len(FOLLOW_UPS))] if rng.random() < follow_up_share else None
        out.append(DistillPrompt(f"q{n:05d}", "single", text, follow))
    for n, p in enumerate(passages(data_dir, passage_tasks, rng)):
        text = PASSAGE_REQUESTS[rng.randrange(len(PASSAGE_REQUESTS))].format(p=p)
        follow = FOLLOW_UPS[rng.randrange(len(FOLLOW_UPS))] if rng.random() < follow_up_share else None
        out.append(DistillPrompt(f"p{n:05d}", "repeat", text, follow))
    return out
