"""Training prompts of several task kinds for the feature drafter's corpus (chat, explanation, QA,
creative writing, math word problems, code, and, built on the LLM's own stage-1 texts, grounded
tasks: summarisation, passage QA, retrieval-style QA over several documents, rewriting, translation).

Everything is synthesised here from templates, topic lists and seeded numbers, so the shared dev
prompts and the project's evaluation prompts (``scripts/data``) stay out of training; ``exclude``
removes any prompt that equals one of them anyway. Grounded prompts need passages, and there is no
text corpus on this machine: stage 1 asks the LLM for articles, notes and documents, and stage 2
quotes those continuations back (the LLM's own text, as a user would paste a document).
"""

from __future__ import annotations

import numpy as np

from specjax.errors import InputError

TOPICS = [
    "gardening", "time management", "renewable energy", "the printing press", "public speaking", "chess",
    "machine learning", "volcanoes", "cooking pasta", "personal finance", "bird migration", "the internet",
    "marathon training", "ancient Rome", "electric cars", "photography", "sleep", "coffee", "space travel",
    "learning a language", "climate change", "jazz music", "bicycles", "vaccines", "city planning", "board games",
    "honey bees", "recycling", "smartphones", "meditation", "the ocean", "libraries", "video games",
    "baking bread", "mountain climbing", "databases", "solar panels", "painting", "trains", "friendship",
    "budget travel", "weather forecasting", "origami", "robotics", "tea", "volunteering", "the moon", "podcasts",
    "architecture", "rainforests", "3D printing", "running a small business", "birdwatching", "cryptography",
    "nutrition", "the Olympic Games", "remote work", "earthquakes", "classical music", "dinosaurs",
    "composting", "the human heart", "antibiotics", "glaciers", "wind turbines", "the stock market", "inflation",
    "ancient Egypt", "the Silk Road", "the Renaissance", "the steam engine", "telescopes", "black holes",
    "photosynthesis", "DNA", "the immune system", "coral reefs", "deserts", "rivers", "forest fires",
    "urban gardening", "public transport", "airports", "shipping containers", "supply chains", "electric grids",
    "batteries", "nuclear power", "water treatment", "plastic pollution", "beekeeping", "dog training",
    "cats", "horses", "wolves", "octopuses", "whales", "butterflies", "mushrooms", "houseplants", "knitting",
    "woodworking", "pottery", "calligraphy", "film making", "theatre", "opera", "hip hop", "rock music",
    "the guitar", "the piano", "dance", "football", "basketball", "tennis", "swimming", "yoga", "cycling races",
    "hiking", "camping", "sailing", "fishing", "skiing", "surfing", "cartography", "geology", "meteorites",
    "the solar system", "Mars exploration", "satellites", "GPS", "radio", "television", "newspapers",
    "social media", "online privacy", "passwords", "open source software", "cloud computing", "compilers",
    "operating systems", "spreadsheets", "web browsers", "email", "search engines", "virtual reality",
    "electric bikes", "self-driving cars", "drones", "semiconductors", "quantum computers", "the metric system",
    "calendars", "clocks", "money", "banks", "taxes", "insurance", "housing", "rent", "job interviews",
    "writing a resume", "team meetings", "project management", "customer service", "marketing", "advertising",
    "negotiation", "leadership", "parenting", "homework", "exams", "universities", "online courses",
    "museums", "zoos", "national parks", "castles", "bridges", "skyscrapers", "tunnels", "canals", "lighthouses",
    "bakeries", "restaurants", "street food", "spices", "chocolate", "cheese", "rice", "potatoes", "olive oil",
    "fermentation", "vegetarian cooking", "food waste", "farming", "irrigation", "tractors", "soil",
    "first aid", "exercise", "posture", "hydration", "dentists", "hospitals", "nursing", "pharmacies",
    "epidemics", "hand washing", "air quality", "noise pollution", "light pollution", "electric scooters",
    "carpooling", "moving house", "wedding planning", "birthday parties", "holidays", "festivals", "fireworks",
    "mythology", "fairy tales", "poetry", "novels", "comics", "translation", "dictionaries", "handwriting",
    "typewriters", "postal services", "maps", "compasses", "the Vikings", "the Industrial Revolution",
    "the Roman aqueducts", "medieval castles", "the history of writing", "the history of medicine",
]

STAGE1 = {
    "chat": ["What are some practical ways to get better at {t}?", "Give me advice about {t} for a beginner.",
             "What are the pros and cons of {t}?", "I want to learn more about {t}. Where should I start?",
             "What are common mistakes people make with {t}?", "How do I explain {t} to my grandparents?",
             "Can you give me five quick tips about {t}?", "Why do some people dislike {t}?"],
    "explain": ["Explain how {t} works.", "What is the history of {t}?", "Why does {t} matter?",
                "Explain {t} to a ten-year-old.", "Describe the main ideas behind {t} in simple terms.",
                "How has {t} changed over the last hundred years?", "What is the science behind {t}?"],
    "qa": ["What is {t}? Answer in two sentences.", "Name three facts about {t}.",
           "Who benefits most from {t}, and why?", "What is one surprising thing about {t}?",
           "Is {t} good for the environment? Give a short answer with reasons."],
    "creative": ["Write a short poem about {t}.", "Write a persuasive paragraph about {t}.",
                 "Draft a friendly email inviting a colleague to a workshop on {t}.",
                 "Write a short story of about 120 words that involves {t}.", "Write a limerick about {t}.",
                 "Write a product description for a new gadget related to {t}.",
                 "Write a diary entry of someone spending a day with {t}."],
    "compare": ["Compare {t} and {u}: what do they have in common and how do they differ?",
                "Which is more useful to learn about first, {t} or {u}? Explain.",
                "Write a short dialogue between an expert on {t} and an expert on {u}."],
    "plan": ["Make a one-week plan for someone who wants to get into {t}.",
             "Create a checklist for a school project about {t}.",
             "Outline a 10-minute presentation about {t}."],
}

# Passages for stage 2: the LLM writes them, stage 2 quotes them back.
PASSAGES = ["Write a short encyclopedia-style article about {t}.",
            "Write a news report about a recent local event related to {t}.",
            "Write the notes of a team meeting about {t}, with names, decisions and dates.",
            "Write a factual paragraph about {t} with numbers and dates.",
            "Write a blog post about a personal experience with {t}.",
            "Write a short biography of a fictional person whose work involves {t}.",
            "Write a customer review of a product or service related to {t}."]

GROUNDED = {
    "summarise": ["Summarise the following text in three sentences.\n\n{p}", "Summarize this:\n\n{p}",
                  "Give a one-paragraph summary of the text below.\n\n{p}",
                  "Summarise the following text as a bulleted list of key points.\n\n{p}",
                  "{p}\n\nTL;DR in two sentences:"],
    "passage_qa": ["Read the passage and answer the question.\nPassage: {p}\nQuestion: What is the main idea of "
                   "the passage?",
                   "Read the passage and answer the question.\nPassage: {p}\nQuestion: Which details in the "
                   "passage are most important?",
                   "{p}\n\nBased only on the text above, what are two facts it states about {t}?",
                   "Passage:\n{p}\n\nQuestion: According to the passage, why does {t} matter? Quote the passage "
                   "where you can."],
    "retrieval": ["Use only the documents below to answer.\n[1] {p}\n[2] {q}\nQuestion: What do the documents "
                  "say about {t}?",
                  "Document 1: {p}\n\nDocument 2: {q}\n\nUsing the documents, answer: how are {t} and {u} "
                  "related? Cite the document numbers.",
                  "Context:\n{p}\n\n{q}\n\nAnswer the question using the context. Question: What is the most "
                  "important point about {u}?"],
    "rewrite": ["Rewrite the following paragraph in plain English for a general audience:\n\n{p}",
                "Rewrite this text so that it sounds more formal:\n\n{p}",
                "Correct any mistakes and improve the style of this text:\n\n{p}",
                "Turn the following text into an email to a colleague:\n\n{p}"],
    "translate": ["Translate into {lang}: {s}", "Translate the following text into {lang}.\n\n{s}",
                  "How do you say this in {lang}? \"{s}\""],
    "extract": ["List every name, date and number mentioned in the text below.\n\n{p}",
                "Write three quiz questions with answers about this text.\n\n{p}",
                "Give this text a title and explain your choice.\n\n{p}"],
}
LANGUAGES = ["French", "Spanish", "German", "Italian", "Portuguese", "Dutch"]

CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "counts the vowels in a sentence",
    "returns the n-th Fibonacci number", "merges two sorted lists", "removes duplicates from a list",
    "finds the largest element of a list", "computes the factorial of a number", "checks whether a word is a "
    "palindrome", "flattens a nested list", "counts word frequencies in a text", "converts Celsius to Fahrenheit",
    "validates an email address", "computes the average of a list of numbers", "sorts a list of dictionaries by a "
    "key", "reads a CSV file and sums a column", "finds the second smallest number", "rotates a list by k "
    "positions", "checks whether two strings are anagrams", "returns the binary representation of an integer",
    "computes the greatest common divisor", "groups a list of words by their first letter", "implements binary "
    "search", "parses a date string", "splits a list into chunks of size n", "capitalises every word in a "
    "sentence", "computes the running total of a list", "finds all pairs that sum to a target",
    "counts the lines in a file", "checks balanced parentheses",
]
CODE_TEMPLATES = ["Write a {lang} function that {task}.", "Write a {lang} function that {task}, with a docstring "
                  "and an example.", "How would you write a program in {lang} that {task}? Explain the code.",
                  "Write unit tests in {lang} for a function that {task}."]
CODE_LANGS = ["Python", "JavaScript", "Java", "C", "Go", "Rust", "Python", "Python"]
SQL = ["Write a SQL query that lists the {n} most recent {things} from a table {table}(id, name, created_at).",
       "Write a SQL query that counts the {things} per {group} in a table {table}(id, {group}, amount).",
       "Explain what this SQL query does: SELECT {group}, SUM(amount) FROM {table} GROUP BY {group} "
       "HAVING SUM(amount) > {n};"]
SQL_WORDS = [("orders", "customer_id", "orders"), ("books", "author", "books"), ("employees", "department", "staff"),
             ("tickets", "status", "tickets"), ("songs", "artist", "songs"), ("trips", "city", "trips")]
CODE_EXPLAIN = ["def f(xs): return [x * x for x in xs if x > 0]", "def g(s): return s == s[::-1]",
                "def h(n): return 1 if n <= 1 else n * h(n - 1)", "def k(d): return sorted(d, key=d.get)[-1]",
                "def m(a, b):\n    while b:\n        a, b = b, a % b\n    return a",
                "def p(words): return {w: len(w) for w in words}", "def q(xs): return sum(xs) / len(xs) if xs else 0",
                "def r(s): return ''.join(c for c in s if c.isalnum()).lower()",
                "const f = (arr) => arr.filter((x, i) => arr.indexOf(x) === i);",
                "for i in range(1, 16):\n    print('Fizz' * (i % 3 == 0) + 'Buzz' * (i % 5 == 0) or i)"]

MATH_PROBLEMS = 1066  # seeded word problems in the stage-1 pool (its size must not depend on how many are asked)
NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Gus", "Hana", "Ivan", "Jo", "Kofi", "Lena", "Mateo", "Nia"]
ITEMS = [("apples", "baskets"), ("books", "shelves"), ("cookies", "boxes"), ("pencils", "packs"),
         ("stickers", "sheets"), ("eggs", "cartons"), ("marbles", "bags"), ("flowers", "vases")]


def _math_problem(rng: np.random.RandomState) -> str:
    """A word problem with seeded numbers (one of six shapes)."""
    name, other = rng.choice(NAMES, 2, replace=False)
    thing, holder = ITEMS[rng.randint(len(ITEMS))]
    a, b, c = (int(x) for x in rng.randint(2, 60, 3))
    speed, hours, price = int(rng.randint(30, 120)), int(rng.randint(2, 9)), int(rng.randint(2, 20))
    shape = rng.randint(6)
    ask = [" Explain step by step.", " Show your reasoning.", " Show your work.", ""][rng.randint(4)]
    if shape == 0:
        return f"{name} has {a} {thing} and buys {b} more. Then {name} gives {min(c, a + b)} to {other}. How many " \
               f"{thing} does {name} have now?{ask}"
    if shape == 1:
        return f"There are {a} {holder} with {b} {thing} in each. How many {thing} are there in total?{ask}"
    if shape == 2:
        return f"A car travels at {speed} km/h for {hours} hours. How far does it go? How long would " \
               f"{speed * hours * 2} " \
               f"km take at the same speed?{ask}"
    if shape == 3:
        return f"{thing.capitalize()} cost {price} dollars each. {name} has {price * a + b} dollars. How many can " \
               f"{name} buy, and how much money is left?{ask}"
    if shape == 4:
        return f"{name} reads {a} pages a day. The book has {a * b + c} pages. How many days does it take to finish " \
               f"the book?{ask}"
    return f"A rectangle is {a} cm long and {b} cm wide. What are its area and its perimeter?{ask}"


def stage1_prompts(n: int, seed: int = 0, exclude=()) -> list[tuple[str, str]]:
    """``n`` distinct (kind, prompt) pairs of the stage-1 kinds (no passages), in a seeded order."""
    rng = np.random.RandomState(seed)
    pool = []
    for kind, templates in STAGE1.items():
        for tpl in templates:
            for t in TOPICS:
                u = TOPICS[rng.randint(len(TOPICS))]
                pool.append((kind, tpl.format(t=t, u=u if u != t else TOPICS[0])))
    for task in CODE_TASKS:
        for tpl in CODE_TEMPLATES:
            for lang in dict.fromkeys(CODE_LANGS):
                pool.append(("code", tpl.format(lang=lang, task=task)))
    for tpl in SQL:
        for things, group, table in SQL_WORDS:
            pool.append(("code", tpl.format(n=int(rng.randint(3, 20)), things=things, group=group, table=table)))
    for snippet in CODE_EXPLAIN:
        for ask in ("Explain what this code does:", "What does this function return? Explain:",
                    "Find any bug in this code and explain:"):
            pool.append(("code", f"{ask}\n{snippet}"))
    pool += [("math", _math_problem(rng)) for _ in range(MATH_PROBLEMS)]  # a pool independent of n
    return _pick(pool, n, rng, exclude)


def passage_prompts(n: int, seed: int = 0, exclude=()) -> list[tuple[str, str]]:
    """``n`` (topic, prompt) pairs asking the LLM for passages that stage 2 quotes."""
    rng = np.random.RandomState(seed + 1)
    pool = [(t, tpl.format(t=t)) for tpl in PASSAGES for t in TOPICS]
    return _pick(pool, n, rng, exclude)


def stage2_prompts(passages: list[tuple[str, str]], n: int, seed: int = 0, exclude=()) -> list[tuple[str, str]]:
    """``n`` (kind, prompt) pairs of grounded kinds quoting ``passages`` [(topic, text), ...]."""
    usable = [(t, p.strip()) for t, p in passages if len(p.split()) >= 30]
    if len(usable) < 2:
        raise InputError(f"stage 2 needs at least 2 passages of 30+ words, got {len(usable)}")
    rng = np.random.RandomState(seed + 2)
    kinds = list(GROUNDED)
    out, seen = [], set(exclude)
    # The distinct prompts a few passages allow are few (2 passages: 110, 10: 790), and asking for more drew
    # forever. Needing n of them takes about n draws where they are plenty; this many means they ran out.
    draws = 200 * n + 10_000
    while len(out) < n:
        draws -= 1
        if draws < 0:
            raise InputError(f"{len(usable)} usable passages (of {len(passages)}; 30+ words each) give only "
                             f"{len(out)} distinct grounded prompts, not the {n} asked for: more --passages or "
                             f"fewer --grounded")
        kind = kinds[rng.randint(len(kinds))]
        tpl = GROUNDED[kind][rng.randint(len(GROUNDED[kind]))]
        (t, p), (u, q) = (usable[i] for i in rng.choice(len(usable), 2, replace=False))
        sentences = [s.strip() for s in p.replace("\n", " ").split(". ") if len(s.split()) >= 5]
        s = ". ".join(sentences[:1 + rng.randint(2)]) + "." if sentences else p[:300]
        prompt = tpl.format(p=p, q=q, t=t, u=u, s=s, lang=LANGUAGES[rng.randint(len(LANGUAGES))])
        if prompt not in seen:
            seen.add(prompt)
            out.append((kind, prompt))
    return out


def _pick(pool, n, rng, exclude):
    held = set(exclude)
    pool = list(dict.fromkeys(p for p in pool if p[1] not in held))
    if n > len(pool):
        raise InputError(f"asked for {n} training prompts, the templates give {len(pool)}")
    order = rng.permutation(len(pool))
    return [pool[i] for i in order[:n]]
