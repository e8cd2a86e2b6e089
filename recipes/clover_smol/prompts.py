"""Prompts for clover-smol's self-distillation data, generated programmatically (offline, deterministic).

    python recipes/clover_smol/prompts.py --out DATA_DIR            # -> DATA_DIR/train.jsonl, DATA_DIR/heldout.jsonl
    python recipes/clover_smol/prompts.py --out DATA_DIR --seed 1   # another draw of the same distribution

Every prompt is one *template instance*: a template (``code.fix_bug``) filled with slot values, whose main
value is its **subject** (``snippet:running_mean``, ``concept:photosynthesis``, ``stdlib:textwrap.dedent``).
Six categories, `TRAIN_COUNTS` prompts each in the train split:

- ``chat``: explanations (concepts x styles), comparisons, advice, fun facts, small talk;
- ``lists``: "List 5 ...", bulleted / numbered / one per line;
- ``writing``: short pieces (haiku, email, slogan, ...) and rewriting (formal, shorter, grammar, summary);
- ``math``: word problems with seeded numbers (arithmetic, percentages, rates, areas, averages);
- ``code``: Python — write a function, how-to, fix a planted bug, write unit tests, and explain / complete /
  document functions drawn from the Python standard library shipped with this interpreter;
- ``structured``: JSON objects and arrays with given fields, extraction to JSON, tool-call JSON, CSV -> JSON,
  markdown tables.

Held-out split (`HELDOUT_COUNTS`: chat, code and structured, 50 each) for evaluating the adapted model
against the base: a seeded fraction (`HELDOUT_FRACTION`) of every subject pool is *reserved*; held-out prompts
are drawn only from reserved subjects and train prompts never use one, in any template. So no template
instance (indeed no subject: no concept, function, snippet, entity) is shared between the splits.

Within a category, prompts are drawn round-robin over its templates (so no template dominates), duplicates
(same text up to case and whitespace) are dropped, and the train file is shuffled so that any prefix is a
representative mix. Ids are ``{template}.{sha1(text)[:10]}``. The set is a function of the seed and of the
standard library's source (the ``stdlib`` subjects), i.e. of the Python version: record it with the data.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import random
import re
import sys
import sysconfig
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

CATEGORIES = ("chat", "lists", "writing", "math", "code", "structured")
TRAIN_COUNTS = {"chat": 650, "lists": 350, "writing": 450, "math": 400, "code": 800, "structured": 350}
HELDOUT_COUNTS = {"chat": 50, "code": 50, "structured": 50}
HELDOUT_FRACTION = 0.12  # of every subject pool of a held-out category
DEFAULT_SEED = 0


@dataclass(frozen=True)
class Prompt:
    template: str  # "category.name"
    subject: str  # "pool:value"; held-out subjects never appear in train
    text: str

    @property
    def category(self) -> str:
        return self.template.split(".", 1)[0]

    @property
    def id(self) -> str:
        return f"{self.template}.{hashlib.sha1(self.text.encode('utf-8')).hexdigest()[:10]}"

    def row(self) -> dict:
        return {"id": self.id, "category": self.category,
                "messages": [{"role": "user", "content": self.text}]}


def _pick(rng: random.Random, items: list, k: int | None = None):
    return rng.choice(items) if k is None else rng.sample(items, k)


# =====================================================================================================================
# chat
# =====================================================================================================================
CONCEPTS = [
    # science
    "photosynthesis", "gravity", "the water cycle", "evolution by natural selection", "plate tectonics", "DNA",
    "the immune system", "black holes", "the greenhouse effect", "electricity", "magnetism", "friction",
    "the speed of light", "atoms and molecules", "chemical reactions", "the periodic table", "vaccines",
    "antibiotics", "the human heart", "the nervous system", "climate change", "ocean tides", "the seasons",
    "rainbows", "volcanoes", "earthquakes", "the Big Bang", "entropy", "nuclear fission", "solar energy",
    "wind power", "the food chain", "ecosystems", "cell division", "genes and heredity", "bacteria and viruses",
    "sound waves", "the moon's phases", "inertia", "energy conservation", "acids and bases", "the ozone layer",
    "renewable energy", "the digestive system", "sleep and the brain", "the scientific method",
    # computing
    "recursion", "machine learning", "neural networks", "the internet", "encryption", "public-key cryptography",
    "databases", "version control", "operating systems", "cloud computing", "compilers", "binary numbers",
    "hash tables", "sorting algorithms", "Big O notation", "object-oriented programming", "APIs",
    "the TCP/IP model", "DNS", "HTTP", "caching", "garbage collection", "multithreading", "unit testing",
    "open-source software", "blockchain", "virtual machines", "containers", "computer memory", "the CPU",
    "large language models", "search engines", "regular expressions", "linked lists", "binary search",
    "functional programming", "JSON", "floating-point numbers", "Git branches", "password hashing",
    # economics, society, history
    "inflation", "supply and demand", "interest rates", "compound interest", "the stock market", "taxes",
    "budgeting", "credit scores", "globalization", "democracy", "the Renaissance", "the Industrial Revolution",
    "the printing press", "the Roman Empire", "the scientific revolution", "human rights", "urbanization",
    "the French Revolution", "the Silk Road", "the Cold War",
    # everyday, health, mind
    "a balanced diet", "meditation", "habits", "procrastination", "critical thinking", "time management",
    "active listening", "the placebo effect", "memory", "stress", "empathy", "negotiation", "public speaking",
    "photography composition", "music scales", "how bread rises", "composting", "recycling", "first aid",
]
EXPLAIN_STYLES = [
    "in simple terms", "to a ten-year-old", "in one short paragraph", "in three sentences", "using an analogy",
    "step by step", "with a concrete example", "briefly", "to a high school student",
    "as if I were a complete beginner", "in plain English without jargon", "and say why it matters",
]
PAIRS = [
    ("weather", "climate"), ("a virus", "a bacterium"), ("speed", "velocity"), ("mass", "weight"),
    ("a list", "a tuple in Python"), ("RAM", "storage"), ("HTTP", "HTTPS"), ("a compiler", "an interpreter"),
    ("TCP", "UDP"), ("a process", "a thread"), ("SQL", "NoSQL databases"), ("machine learning", "deep learning"),
    ("stocks", "bonds"), ("a debit card", "a credit card"), ("inflation", "deflation"), ("a democracy", "a republic"),
    ("an alligator", "a crocodile"), ("a frog", "a toad"), ("baking soda", "baking powder"), ("jam", "jelly"),
    ("empathy", "sympathy"), ("affect", "effect"), ("a simile", "a metaphor"), ("a hurricane", "a tornado"),
    ("an atom", "a molecule"), ("nuclear fission", "nuclear fusion"), ("AC", "DC electricity"),
    ("a star", "a planet"), ("a meteor", "a meteorite"), ("git merge", "git rebase"), ("a class", "an object"),
    ("an array", "a linked list"), ("a stack", "a queue"), ("authentication", "authorization"),
    ("frontend", "backend development"), ("a library", "a framework"), ("latency", "bandwidth"),
    ("revenue", "profit"), ("a hypothesis", "a theory"), ("correlation", "causation"),
]
GOALS = [
    "improve my sleep", "learn to cook simple meals", "become a better writer", "save money each month",
    "learn Python quickly", "stay motivated while studying", "make new friends in a new city",
    "prepare for a job interview", "read more books", "reduce screen time", "start running",
    "keep my plants alive", "learn a new language", "organize my closet", "be more productive working from home",
    "manage stress at work", "give better presentations", "get better at chess", "write a good resume",
    "eat more vegetables", "start a small vegetable garden", "learn to draw", "improve my memory",
    "become more confident", "plan a budget trip", "keep a journal", "get up earlier", "learn touch typing",
    "prepare for a marathon", "declutter my desk", "take better photos with my phone", "study for a math exam",
    "be a better listener", "contribute to open source", "learn to play the guitar", "drink more water",
    "spend less on groceries", "write clean code", "debug my programs faster", "remember people's names",
    "make my morning routine calmer", "cook healthier meals", "get started with meditation",
    "prepare for a long flight", "teach my dog to sit", "start a podcast", "write a cover letter",
    "understand my electricity bill", "set goals for the new year", "build a reading habit with my kids",
]
ANIMALS = [
    "octopuses", "elephants", "penguins", "honeybees", "dolphins", "owls", "cats", "dogs", "sharks", "crows",
    "giraffes", "koalas", "ants", "butterflies", "tortoises", "hummingbirds", "bats", "whales", "chameleons",
    "axolotls", "wolves", "horses", "parrots", "jellyfish", "camels", "sloths", "flamingos", "seahorses",
]
JOKE_TOPICS = [
    "programmers", "cats", "math", "coffee", "the weather", "computers", "vegetables", "dinosaurs", "music",
    "teachers", "robots", "the ocean", "books", "space", "pizza", "physics", "soccer", "libraries",
]
SMALLTALK = [
    "Hi! How are you today?", "Hello, who are you?", "What can you help me with?", "Good morning!",
    "Can you tell me a little about yourself?", "I'm bored. Any ideas for something fun to do?",
    "Thanks for your help earlier!", "What's a good question to start a conversation with a stranger?",
    "I had a long day. Can you cheer me up?", "What do you like to talk about?",
    "Give me a random interesting fact.", "Say something nice to start my day.",
    "What is your favorite book and why?", "Recommend a hobby I could start this weekend.",
    "Can you help me pick a name for my new cat?", "What should I cook for dinner tonight?",
]


def chat_prompts() -> Iterator[Prompt]:
    for c in CONCEPTS:
        s = f"concept:{c}"
        for style in EXPLAIN_STYLES:
            yield Prompt("chat.explain", s, f"Explain {c} {style}.")
        yield Prompt("chat.what_is", s, f"Give me a short definition of {c}.")
        yield Prompt("chat.what_is", s, f"What should I know about {c}? Keep the answer short.")
        yield Prompt("chat.understand", s, f"Can you help me understand {c}?")
        yield Prompt("chat.understand", s, f"I'm studying {c}. What are the key ideas I should know?")
        yield Prompt("chat.why_matters", s, f"Why is it important to understand {c}?")
        yield Prompt("chat.why_matters", s, f"What are common misconceptions about {c}?")
        for n in (2, 3, 4):
            yield Prompt("chat.summarize", s, f"Summarize {c} in {n} sentences.")
        yield Prompt("chat.summarize", s, f"Give me a short overview of {c}.")
    for a, b in PAIRS:
        s = f"pair:{a}|{b}"
        yield Prompt("chat.compare", s, f"What is the difference between {a} and {b}?")
        yield Prompt("chat.compare", s, f"Compare {a} and {b} in a few sentences.")
        yield Prompt("chat.compare", s, f"How are {a} and {b} similar, and how are they different?")
        yield Prompt("chat.compare", s, f"I always confuse {a} and {b}. Can you explain the difference?")
    for g in GOALS:
        s = f"goal:{g}"
        yield Prompt("chat.advice", s, f"How can I {g}?")
        yield Prompt("chat.advice", s, f"What's a good way to {g}?")
        yield Prompt("chat.advice", s, f"I want to {g}. Where should I start?")
        yield Prompt("chat.advice", s, f"Give me three practical tips to {g}.")
        yield Prompt("chat.advice", s, f"What mistakes should I avoid when trying to {g}?")
    for a in ANIMALS:
        s = f"animal:{a}"
        yield Prompt("chat.fun_fact", s, f"Tell me a fun fact about {a}.")
        yield Prompt("chat.fun_fact", s, f"What is something surprising about {a}?")
        yield Prompt("chat.fun_fact", s, f"How do {a} communicate?")
        yield Prompt("chat.fun_fact", s, f"Where do {a} live and what do they eat?")
    for t in JOKE_TOPICS:
        s = f"joke:{t}"
        yield Prompt("chat.joke", s, f"Tell me a joke about {t}.")
        yield Prompt("chat.joke", s, f"Tell me a short, clean pun about {t}.")
    for i, text in enumerate(SMALLTALK):
        yield Prompt("chat.smalltalk", f"smalltalk:{i}", text)


# =====================================================================================================================
# lists
# =====================================================================================================================
LIST_TOPICS = [
    "tips for staying focused while studying", "fruits that are rich in vitamin C", "ways to save money on food",
    "famous scientists and what they are known for", "built-in functions in Python", "countries in South America",
    "benefits of regular exercise", "board games for families", "things to pack for a beach trip",
    "programming languages and what they are used for", "ideas for a rainy day", "healthy breakfast ideas",
    "classic novels everyone should read", "ways to reduce plastic waste", "questions to ask in a job interview",
    "planets in our solar system", "common Linux commands", "tips for writing a good email",
    "houseplants that are easy to care for", "ways to be more productive in the morning", "musical instruments",
    "popular tourist attractions in Europe", "vegetables that grow well in pots", "signs of dehydration",
    "skills every software engineer should have", "ways to practice gratitude", "dog breeds good for apartments",
    "tips for a good night's sleep", "uses of baking soda", "inventions that changed the world",
    "ways to make a presentation engaging", "Git commands for beginners", "spices used in Indian cooking",
    "mammals that live in the ocean", "tips for learning a new language", "ingredients for a basic pancake recipe",
    "ways to stay safe online", "things to do in a new city", "elements of a good story",
    "exercises you can do without equipment", "common logical fallacies", "ways to cool down a room in summer",
    "data structures every programmer should know", "renewable energy sources", "birthday party themes for kids",
    "ways to improve team communication", "reasons to learn to code", "fun weekend projects",
    "steps to change a flat tire", "topics for a school science fair", "ways to reduce stress",
    "HTTP status codes and their meanings", "largest countries by area", "types of clouds",
    "things to check before submitting an essay", "snacks under 200 calories", "ancient civilizations",
    "tips for a first-time manager", "common SQL commands", "hobbies that cost almost nothing",
    "ways to learn math more effectively", "features of a good password", "famous paintings",
    "things that make a website easy to use", "kitchen tools every beginner cook needs", "careers in healthcare",
    "ways to help the environment at home", "questions to ask before buying a used car", "Olympic sports",
    "symptoms of the common cold", "tips for working from home", "Python libraries for data analysis",
    "ideas for a short story", "ways to show appreciation to a coworker", "facts about the Moon",
    "steps to start a small business", "things to consider when choosing a laptop", "types of renewable resources",
    "good habits for programmers", "rivers in Africa", "ways to keep kids busy indoors", "types of triangles",
    "primary and secondary colors", "reasons why people travel", "musical genres", "parts of a flower",
]
LIST_NUMBERS = [3, 4, 5, 6, 7, 8, 10]


def list_prompts() -> Iterator[Prompt]:
    for t in LIST_TOPICS:
        s = f"list:{t}"
        for n in LIST_NUMBERS:
            yield Prompt("lists.plain", s, f"List {n} {t}.")
            yield Prompt("lists.bulleted", s, f"Give me {n} {t} as a bulleted list.")
            yield Prompt("lists.numbered", s, f"What are {n} {t}? Use a numbered list.")
            yield Prompt("lists.one_per_line", s, f"Name {n} {t}, one per line, with no extra text.")
            yield Prompt("lists.explained", s, f"List {n} {t}, each with a one-sentence explanation.")


# =====================================================================================================================
# writing
# =====================================================================================================================
THEMES = [
    "the ocean", "autumn leaves", "a city at night", "friendship", "a rainy morning", "the first snow",
    "a cup of coffee", "an old library", "the stars", "a lost umbrella", "spring flowers", "a quiet forest",
    "a train journey", "the moon", "learning to code", "a grandmother's kitchen", "a summer storm",
    "a mountain sunrise", "a busy market", "a cat asleep in the sun", "the last day of school", "a lighthouse",
    "a bicycle ride", "an empty playground", "a robot who wants to paint", "a dragon who is afraid of the dark",
    "a time traveler's mistake", "a talking tree", "a letter that arrives fifty years late", "a tiny astronaut",
    "a bakery at dawn", "a message in a bottle", "the sound of rain", "a first day at a new job",
]
PIECES = [
    ("haiku", "Write a haiku about {t}."), ("poem", "Write a short poem about {t}."),
    ("limerick", "Write a limerick about {t}."), ("story", "Write a two-sentence story about {t}."),
    ("story", "Write a very short story (under 100 words) about {t}."),
    ("description", "Describe {t} in a vivid paragraph."),
]
EMAILS = [
    ("my manager", "asking for a day off next Friday"), ("a colleague", "thanking them for their help on a project"),
    ("a landlord", "reporting a leaking kitchen tap"), ("a teacher", "explaining that my child will miss school"),
    ("a client", "following up on an unpaid invoice"), ("my team", "announcing the new meeting schedule"),
    ("a hiring manager", "following up after an interview"), ("a friend", "inviting them to a birthday dinner"),
    ("customer support", "asking for a refund for a damaged product"), ("a neighbor", "about a lost cat"),
    ("a professor", "asking for an extension on an assignment"), ("a supplier", "requesting a price quote"),
    ("the organizers", "declining an invitation to speak at a conference"), ("new users", "welcoming them to our app"),
    ("a mentor", "asking for advice about a career change"), ("my team", "sharing the results of the quarter"),
]
PRODUCTS = [
    "a reusable water bottle", "noise-cancelling headphones", "a smart desk lamp", "an ergonomic office chair",
    "a handmade ceramic mug", "a lightweight hiking backpack", "an electric kettle", "a solar phone charger",
    "a note-taking app", "a beginner's yoga mat", "a weekly meal-planning service", "a mechanical keyboard",
    "organic dark chocolate", "a children's science kit", "a cast-iron skillet", "a language-learning app",
]
BUSINESSES = [
    "a neighborhood bakery", "a bike repair shop", "a dog-walking service", "a small bookstore", "a coffee truck",
    "an online tutoring service", "a plant nursery", "a cleaning company", "a local gym", "a vegan restaurant",
    "a web design studio", "a farmers' market", "a music school", "a computer repair shop",
]
OCCASIONS = [
    "a friend's wedding", "a colleague's retirement", "a team's product launch", "a graduation party",
    "my parents' anniversary", "the opening of a community garden", "a farewell lunch for an intern",
]
SENT_SUBJECTS = ["The manager", "My neighbor", "Our team", "The new intern", "The city council", "My sister",
                 "The company", "The teacher", "The developers", "The committee", "My landlord", "The students"]
SENT_PREDICATES = [
    "decided to postpone the meeting until next week", "forgot to send the invoice to the client",
    "is planning a trip to the mountains in the summer", "finished the report two days before the deadline",
    "has been asking for a bigger budget for months", "will announce the new policy on Monday",
    "could not find the keys to the storage room", "wants everyone to arrive ten minutes early",
    "fixed the bug that crashed the app every night", "painted the fence a bright shade of blue",
    "is worried that the project is running late", "bought too much food for the party",
    "explained the new rules very clearly", "complained about the noise from the construction site",
    "raised money for the local animal shelter", "moved the deadline because of the holidays",
]
CASUAL = [
    "hey, can u send me the file asap? thx", "gonna be late, traffic is crazy", "that meeting was sooo long lol",
    "pls fix the printer, it's broken again", "we need more coffee in the office, like now",
    "can't make it tmrw, something came up", "the report's done, check it out when u can",
    "yo, the server is down again", "thx for the help, ur the best", "dunno if we can finish by friday tbh",
    "lemme know if u need anything", "the new guy seems pretty cool",
]
FORMAL = [
    "We regret to inform you that your application has not been successful.",
    "Please ensure that all documents are submitted prior to the deadline.",
    "The committee has resolved to defer the decision until further notice.",
    "Kindly refrain from using mobile phones during the presentation.",
    "Your request has been received and will be processed in due course.",
    "Attendance at the orientation session is mandatory for all new employees.",
    "We would be grateful if you could confirm your availability at your earliest convenience.",
    "The aforementioned changes will take effect from the first of next month.",
]
GRAMMAR_ERRORS = [
    "She don't like going to the gym on mondays.", "Me and him was late to the meeting yesterday.",
    "Their going to the park after lunch, aren't they.", "The list of items are on the table.",
    "I could of finished the work if I had more time.", "Each of the students have a laptop.",
    "He go to school by bus every days.", "Its a beautiful day, lets go outside.",
    "The data shows that less people are reading books.", "Between you and I, the plan won't work.",
    "We was planning to visit our grandparents but it rain.", "Who's book is this on the desk.",
    "The team have made there decision already.", "I seen that movie three times last year.",
    "Neither the manager nor the employees was informed.", "She is more smarter than her brother.",
    "There is many reasons to learn programming.", "He don't know nothing about the problem.",
    "Your welcome to join us for dinner tonight.", "The cat licked it's paws after eating.",
]
PARAGRAPHS = [
    "Honeybees live in colonies that can contain tens of thousands of individuals. Most of them are worker bees, "
    "which collect nectar and pollen, build the comb and care for the young. A single queen lays the eggs, and "
    "male drones exist mainly to mate. Bees communicate the location of flowers with a movement called the "
    "waggle dance.",
    "The city plans to convert an old railway line into a park with walking paths, gardens and a bike lane. "
    "Construction will start in the spring and should take about two years. Local shops hope the park will bring "
    "more visitors, while some residents worry about noise and parking.",
    "Version control systems record changes to files over time. They let developers work on the same code base "
    "without overwriting each other's work, go back to earlier versions when something breaks, and review what "
    "changed and why. Git is the most widely used version control system today.",
    "Regular physical activity improves heart health, helps control weight and lowers the risk of several "
    "diseases. It also has benefits for mental health, such as better mood and sleep. Experts recommend at least "
    "150 minutes of moderate exercise a week for most adults.",
    "The printing press, developed by Johannes Gutenberg around 1440, made it possible to produce books quickly "
    "and cheaply. Before it, books were copied by hand, which made them rare and expensive. The spread of printed "
    "books helped increase literacy and the exchange of ideas across Europe.",
    "Our quarterly survey shows that customers like the new app design but find the checkout process confusing. "
    "Many users abandon their carts on the payment page. The product team will simplify the payment form and test "
    "the new version with a small group of users next month.",
    "Composting turns food scraps and garden waste into a rich soil amendment. Microorganisms break down the "
    "material when it has the right mix of green and brown ingredients, moisture and air. A well-managed compost "
    "pile does not smell bad and can be ready in a few months.",
    "The library will extend its opening hours during the exam period. From the first of May, the main reading "
    "room will be open until midnight on weekdays. Students must show their ID card after 8 p.m., and the cafe "
    "will stay open until 10 p.m.",
    "Sleep plays an important role in memory. During deep sleep, the brain replays and strengthens what was "
    "learned during the day. People who sleep poorly after studying tend to remember less than those who get a "
    "full night of rest.",
    "A startup has built a small robot that sorts recyclable materials at waste facilities. Using cameras and "
    "machine learning, it recognizes plastic, paper and metal and picks them off a conveyor belt. The company says "
    "the robot works twice as fast as a person and never gets tired.",
    "Tea was first drunk in China thousands of years ago, originally as a medicine. Over time it became an "
    "everyday drink and spread along trade routes to Japan, India and later Europe. Today it is the most consumed "
    "drink in the world after water.",
    "The software update fixes a problem that caused the app to crash when uploading large photos. It also adds a "
    "dark mode and makes search results load faster. Users are encouraged to install the update as soon as "
    "possible.",
]
LANGUAGES = ["French", "Spanish", "German", "Italian"]


def _sentences() -> list[str]:
    return [f"{s} {p}." for s in SENT_SUBJECTS for p in SENT_PREDICATES]


def writing_prompts() -> Iterator[Prompt]:
    for t in THEMES:
        for kind, template in PIECES:
            yield Prompt(f"writing.{kind}", f"theme:{t}", template.format(t=t))
    for who, what in EMAILS:
        s = f"email:{who}|{what}"
        yield Prompt("writing.email", s, f"Write a short email to {who} {what}.")
        yield Prompt("writing.email", s, f"Draft a polite, three-sentence message to {who} {what}.")
    for p in PRODUCTS:
        yield Prompt("writing.product", f"product:{p}", f"Write a short product description for {p}.")
        yield Prompt("writing.product", f"product:{p}", f"Write a tweet announcing {p}.")
    for b in BUSINESSES:
        yield Prompt("writing.slogan", f"business:{b}", f"Write a catchy slogan for {b}.")
        yield Prompt("writing.slogan", f"business:{b}", f"Suggest five possible names for {b}.")
    for o in OCCASIONS:
        yield Prompt("writing.toast", f"occasion:{o}", f"Write a short toast for {o}.")
        yield Prompt("writing.toast", f"occasion:{o}", f"Write a warm card message for {o}.")
    for sent in _sentences():
        s = f"sentence:{sent}"
        yield Prompt("writing.rewrite", s, f"Rewrite this sentence to sound more formal: \"{sent}\"")
        yield Prompt("writing.rewrite", s, f"Paraphrase the following sentence: {sent}")
        yield Prompt("writing.rewrite", s, f"Turn this statement into a question: {sent}")
        yield Prompt("writing.rewrite", s, f"Rewrite this sentence in the passive voice if possible: {sent}")
        for lang in LANGUAGES:
            yield Prompt("writing.translate", s, f"Translate into {lang}: {sent}")
    for c in CASUAL:
        yield Prompt("writing.formalize", f"casual:{c}", f"Rewrite this message in a professional tone: \"{c}\"")
        yield Prompt("writing.formalize", f"casual:{c}", f"Make this text message polite and clear: {c}")
    for f in FORMAL:
        yield Prompt("writing.simplify", f"formal:{f}", f"Rewrite this in simple, friendly words: \"{f}\"")
        yield Prompt("writing.simplify", f"formal:{f}", f"Make this sentence shorter: {f}")
    for g in GRAMMAR_ERRORS:
        yield Prompt("writing.grammar", f"grammar:{g}", f"Fix the grammar in this sentence: {g}")
        yield Prompt("writing.grammar", f"grammar:{g}", f"Correct the mistakes: \"{g}\"")
        yield Prompt("writing.grammar", f"grammar:{g}", f"What is wrong with this sentence? \"{g}\"")
    for i, p in enumerate(PARAGRAPHS):
        s = f"paragraph:{i}"
        yield Prompt("writing.summarize", s, f"Summarize this paragraph in one sentence:\n\n{p}")
        yield Prompt("writing.summarize", s, f"Give me a title for this text:\n\n{p}")
        yield Prompt("writing.summarize", s, f"Write three bullet points that capture the main ideas:\n\n{p}")
        yield Prompt("writing.summarize", s, f"Explain this text to a child:\n\n{p}")


# =====================================================================================================================
# math (numbers drawn from a seeded generator; `math_prompts` yields a finite pool)
# =====================================================================================================================
NAMES = [("Anna", "she"), ("Ben", "he"), ("Carla", "she"), ("David", "he"), ("Emma", "she"), ("Farid", "he"),
         ("Grace", "she"), ("Hiro", "he"), ("Isabel", "she"), ("Jamal", "he"), ("Kira", "she"), ("Luis", "he"),
         ("Maya", "she"), ("Noah", "he"), ("Olga", "she"), ("Pedro", "he"), ("Quinn", "they"), ("Rosa", "she"),
         ("Sam", "they"), ("Tariq", "he"), ("Uma", "she"), ("Victor", "he"), ("Wen", "she"), ("Yusuf", "he")]
ITEMS = ["apples", "marbles", "stickers", "books", "pencils", "cookies", "stamps", "oranges", "cards", "shells",
         "coins", "cupcakes", "eggs", "flowers", "toy cars", "notebooks"]
MATH_STYLES = ["", " Show your work.", " Explain your reasoning step by step.", " Give just the final answer."]


def _math_one(kind: str, rng: random.Random) -> str:
    name, pro = _pick(rng, NAMES)
    verb_has = "have" if pro == "they" else "has"
    item = _pick(rng, ITEMS)
    r = rng.randint
    if kind == "add":
        a, b = r(3, 60), r(2, 40)
        gets = "get" if pro == "they" else "gets"
        return f"{name} has {a} {item}. {pro.capitalize()} {gets} {b} more. How many {item} does {name} have now?"
    if kind == "subtract":
        a = r(20, 120)
        b = r(2, a - 1)
        return f"{name} had {a} {item} and gave {b} of them to a friend. How many {item} are left?"
    if kind == "multiply":
        a, b = r(3, 24), r(2, 15)
        return f"A box holds {a} {item}. How many {item} are there in {b} boxes?"
    if kind == "divide":
        b = r(2, 12)
        a = b * r(2, 20)
        return f"{name} wants to share {a} {item} equally among {b} friends. How many {item} does each friend get?"
    if kind == "two_step":
        a, b, c = r(2, 9), r(3, 12), r(1, 20)
        return (f"{name} buys {a} packs of {item} with {b} in each pack, then loses {min(c, a * b - 1)}. "
                f"How many {item} does {name} have?")
    if kind == "money":
        price, qty = r(2, 40) + rng.choice([0, 0.25, 0.5, 0.75, 0.99]), r(2, 9)
        paid = math.ceil(price * qty / 10 + 1) * 10
        return (f"A notebook costs ${price:.2f}. {name} buys {qty} notebooks and pays with ${paid}. "
                f"How much change does {name} get?")
    if kind == "percent":
        price, off = r(20, 400), rng.choice([5, 10, 15, 20, 25, 30, 40, 50])
        return f"A jacket costs ${price}. It is on sale for {off}% off. What is the sale price?"
    if kind == "speed":
        v, t = r(30, 110), r(2, 8)
        return f"A car travels at {v} km/h for {t} hours. How far does it go?"
    if kind == "time":
        d, v = r(2, 20) * 10, rng.choice([10, 20, 40, 50, 60, 80])
        return f"A train travels {d} km at a constant speed of {v} km/h. How long does the trip take?"
    if kind == "area":
        a, b = r(2, 30), r(2, 30)
        return f"A rectangular garden is {a} meters long and {b} meters wide. What is its area and its perimeter?"
    if kind == "average":
        scores = [r(50, 100) for _ in range(r(3, 6))]
        return f"{name}'s test scores are {', '.join(map(str, scores))}. What is the average score?"
    if kind == "age":
        a, d = r(5, 15), r(2, 30)
        return (f"{name} is {a} years old. {name}'s mother is {d + 20} years older. "
                f"How old will the mother be in {r(1, 10)} years?")
    if kind == "recipe":
        a, b, c = r(1, 4), r(2, 6), r(2, 5)
        return f"A recipe needs {a} cups of flour for {b} people. How many cups are needed for {b * c} people?"
    if kind == "hours":
        h, w = r(10, 40), r(8, 30)
        return f"{name} works {h} hours a week and earns ${w} per hour. How much does {name} earn in {r(2, 6)} weeks?"
    if kind == "fraction":
        total, num, den = r(4, 30) * 4, r(1, 3), 4
        return (f"There are {total} students in a school club. {num}/{den} of them are in the chess group. "
                "How many students are in the chess group?")
    if kind == "compare":
        a, b = r(10, 99), r(10, 99)
        return f"{name} {verb_has} {a} {item} and a friend has {b}. How many more {item} does the one with more have?"
    raise ValueError(kind)


MATH_KINDS = ["add", "subtract", "multiply", "divide", "two_step", "money", "percent", "speed", "time", "area",
              "average", "age", "recipe", "hours", "fraction", "compare"]
MATH_POOL_PER_KIND = 120


def math_prompts(rng: random.Random) -> Iterator[Prompt]:
    for kind in MATH_KINDS:
        for _ in range(MATH_POOL_PER_KIND):
            text = _math_one(kind, rng) + _pick(rng, MATH_STYLES)
            yield Prompt(f"math.{kind}", f"math:{text}", text)


# =====================================================================================================================
# code
# =====================================================================================================================
FUNCTION_TASKS = [
    ("is_palindrome", "checks whether a string is a palindrome"),
    ("fibonacci", "returns the n-th Fibonacci number"),
    ("factorial", "computes the factorial of a non-negative integer"),
    ("count_vowels", "counts the vowels in a string"),
    ("reverse_words", "reverses the order of the words in a sentence"),
    ("is_prime", "checks whether a number is prime"),
    ("primes_up_to", "returns all prime numbers up to n"),
    ("flatten", "flattens a nested list"),
    ("remove_duplicates", "removes duplicates from a list while keeping the order"),
    ("word_count", "counts how many times each word appears in a text"),
    ("merge_dicts", "merges two dictionaries, with values from the second winning"),
    ("second_largest", "returns the second largest number in a list"),
    ("gcd", "computes the greatest common divisor of two integers"),
    ("lcm", "computes the least common multiple of two integers"),
    ("celsius_to_fahrenheit", "converts a temperature from Celsius to Fahrenheit"),
    ("chunk", "splits a list into chunks of size n"),
    ("is_anagram", "checks whether two strings are anagrams"),
    ("capitalize_words", "capitalizes the first letter of every word"),
    ("binary_search", "performs binary search on a sorted list"),
    ("bubble_sort", "sorts a list with bubble sort"),
    ("merge_sorted", "merges two sorted lists into one sorted list"),
    ("transpose", "transposes a matrix given as a list of lists"),
    ("sum_digits", "returns the sum of the digits of an integer"),
    ("to_binary", "converts a non-negative integer to its binary representation as a string"),
    ("running_total", "returns the running totals of a list of numbers"),
    ("most_common", "returns the most common element of a list"),
    ("is_valid_email", "checks whether a string looks like a valid email address"),
    ("read_lines", "reads a text file and returns its non-empty lines"),
    ("unique_chars", "checks whether all characters in a string are unique"),
    ("rotate_list", "rotates a list to the right by k positions"),
    ("pairs_with_sum", "finds all pairs of numbers in a list that add up to a target"),
    ("group_by_length", "groups words by their length in a dictionary"),
    ("caesar_cipher", "encrypts a string with a Caesar cipher"),
    ("roman_to_int", "converts a Roman numeral to an integer"),
    ("int_to_roman", "converts an integer to a Roman numeral"),
    ("balanced_brackets", "checks whether the brackets in a string are balanced"),
    ("median", "returns the median of a list of numbers"),
    ("mean_and_std", "returns the mean and standard deviation of a list of numbers"),
    ("slugify", "turns a title into a URL slug"),
    ("camel_to_snake", "converts a camelCase string to snake_case"),
    ("snake_to_camel", "converts a snake_case string to camelCase"),
    ("matrix_multiply", "multiplies two matrices given as lists of lists"),
    ("dict_invert", "inverts a dictionary, swapping keys and values"),
    ("longest_word", "returns the longest word in a sentence"),
    ("count_lines", "counts the lines in a file"),
    ("is_leap_year", "checks whether a year is a leap year"),
    ("days_between", "returns the number of days between two dates given as strings"),
    ("parse_csv_line", "splits a line of comma-separated values into a list"),
    ("compress_string", "compresses a string using run-length encoding"),
    ("decompress_string", "decodes a run-length encoded string"),
    ("find_missing", "finds the missing number in a list containing 1 to n with one number missing"),
    ("power_set", "returns all subsets of a list"),
    ("permutations", "returns all permutations of a string"),
    ("clamp", "clamps a number between a minimum and a maximum"),
    ("normalize", "scales a list of numbers to the range 0 to 1"),
    ("dot_product", "computes the dot product of two vectors"),
    ("hamming_distance", "computes the Hamming distance between two strings"),
    ("levenshtein", "computes the edit distance between two strings"),
    ("top_k", "returns the k largest numbers in a list"),
    ("safe_divide", "divides two numbers and returns None when dividing by zero"),
    ("retry", "calls a function up to three times until it succeeds"),
    ("timer_decorator", "is a decorator that prints how long a function takes"),
    ("memoize", "is a decorator that caches the results of a function"),
    ("json_pretty", "loads a JSON file and prints it with indentation"),
    ("list_files", "lists all .txt files in a directory"),
    ("char_frequency", "returns a dictionary with the frequency of each character"),
    ("is_sorted", "checks whether a list is sorted"),
    ("zip_to_dict", "builds a dictionary from a list of keys and a list of values"),
    ("filter_even", "returns only the even numbers from a list"),
    ("square_list", "returns the squares of a list of numbers"),
    ("title_case", "converts a sentence to title case, leaving short words lowercase"),
    ("validate_password", "checks that a password has at least 8 characters, a digit and an uppercase letter"),
    ("seconds_to_hms", "converts a number of seconds to hours, minutes and seconds"),
    ("fizzbuzz", "prints the FizzBuzz sequence up to n"),
    ("triangle_area", "computes the area of a triangle from its three sides"),
    ("bank_account", "is a small BankAccount class with deposit and withdraw methods"),
    ("stack_class", "is a Stack class with push, pop and peek"),
    ("queue_class", "is a Queue class built on collections.deque"),
    ("linked_list", "is a singly linked list class with append and a method to print it"),
    ("count_words_file", "counts the words in a text file"),
]
FUNCTION_SUFFIXES = ["", " Include a docstring.", " Use type hints.", " Keep it short.",
                     " Add a short example of how to call it."]
HOWTOS = [
    "read a file line by line", "sort a dictionary by its values", "reverse a list",
    "check if a key is in a dictionary",
    "remove whitespace from the ends of a string", "convert a string to an integer safely",
    "get the current date and time", "write a list of dictionaries to a CSV file", "parse JSON from a string",
    "make an HTTP request with the standard library", "measure how long some code takes", "copy a file",
    "create a directory if it does not exist", "iterate over two lists at the same time", "merge two lists",
    "find the index of an item in a list", "count items with collections.Counter", "use a list comprehension",
    "use a dictionary comprehension", "handle exceptions with try and except", "write a context manager",
    "use enumerate in a for loop", "generate random numbers", "format a float with two decimals",
    "use f-strings", "split a string by commas", "join a list of strings", "read command-line arguments",
    "use argparse", "define a dataclass", "use lambda functions", "sort a list of tuples by the second element",
    "use the logging module", "read environment variables", "run a shell command", "work with file paths using pathlib",
    "use a generator", "remove an item from a list", "get unique values from a list", "check the type of a variable",
    "use *args and **kwargs", "write a simple class with a constructor", "use a set to find common elements",
    "pretty-print a nested dictionary", "use regular expressions to find all numbers in a text",
    "compute the difference between two dates", "use zip to create a dictionary", "use a while loop",
    "write unit tests with unittest", "use type hints",
]
HOWTO_TEMPLATES = ["How do I {h} in Python?", "Show me how to {h} in Python with a short example.",
                   "What is the best way to {h} in Python?"]

# Small correct functions: planted bugs (fix_bug) and test targets (unit_test).
SNIPPETS: dict[str, tuple[str, list[tuple[str, str]]]] = {
    # name: (correct source, [(substring, buggy replacement), ...])
    "average": ("def average(numbers):\n    if not numbers:\n        return 0\n"
                "    return sum(numbers) / len(numbers)\n",
                [("sum(numbers) / len(numbers)", "sum(numbers) / (len(numbers) - 1)"),
                 ("if not numbers:", "if numbers:")]),
    "find_max": ("def find_max(values):\n    best = values[0]\n    for v in values:\n        if v > best:\n"
                 "            best = v\n    return best\n",
                 [("if v > best:", "if v < best:"), ("    return best\n", "")]),
    "count_words": ("def count_words(text):\n    counts = {}\n    for word in text.split():\n"
                    "        counts[word] = counts.get(word, 0) + 1\n    return counts\n",
                    [("counts.get(word, 0) + 1", "counts[word] + 1"), ("text.split()", "text")]),
    "factorial": ("def factorial(n):\n    result = 1\n    for i in range(2, n + 1):\n        result *= i\n"
                  "    return result\n",
                  [("range(2, n + 1)", "range(2, n)"), ("result = 1", "result = 0")]),
    "is_even": ("def is_even(n):\n    return n % 2 == 0\n",
                [("n % 2 == 0", "n % 2 == 1"), ("n % 2 == 0", "n / 2 == 0")]),
    "reverse_string": ("def reverse_string(s):\n    return s[::-1]\n", [("s[::-1]", "s[::1]"), ("s[::-1]", "s[-1]")]),
    "sum_list": ("def sum_list(items):\n    total = 0\n    for x in items:\n        total += x\n    return total\n",
                 [("total += x", "total = x"), ("    return total\n", "        return total\n")]),
    "fibonacci": ("def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
                  [("a, b = b, a + b", "a = b\n        b = a + b"), ("return a", "return b")]),
    "is_palindrome": ("def is_palindrome(s):\n    s = s.lower().replace(\" \", \"\")\n    return s == s[::-1]\n",
                      [("s == s[::-1]", "s == s[::1]"), ("s = s.lower().replace(\" \", \"\")\n    ", "")]),
    "celsius_to_fahrenheit": ("def celsius_to_fahrenheit(c):\n    return c * 9 / 5 + 32\n",
                              [("c * 9 / 5 + 32", "c * 5 / 9 + 32"), ("c * 9 / 5 + 32", "(c + 32) * 9 / 5")]),
    "last_item": ("def last_item(items):\n    if not items:\n        return None\n    return items[-1]\n",
                  [("items[-1]", "items[len(items)]"), ("if not items:", "if items:")]),
    "count_vowels": ("def count_vowels(text):\n    return sum(1 for ch in text.lower() if ch in \"aeiou\")\n",
                     [("text.lower()", "text"), ("if ch in \"aeiou\"", "if ch not in \"aeiou\"")]),
    "append_item": ("def append_item(item, items=None):\n    if items is None:\n        items = []\n"
                    "    items.append(item)\n    return items\n",
                    [("def append_item(item, items=None):\n    if items is None:\n        items = []\n",
                      "def append_item(item, items=[]):\n")]),
    "remove_negatives": ("def remove_negatives(numbers):\n    return [n for n in numbers if n >= 0]\n",
                         [("n >= 0", "n > 0"), ("n >= 0", "n <= 0")]),
    "binary_search": ("def binary_search(items, target):\n    lo, hi = 0, len(items) - 1\n    while lo <= hi:\n"
                      "        mid = (lo + hi) // 2\n        if items[mid] == target:\n            return mid\n"
                      "        if items[mid] < target:\n            lo = mid + 1\n"
                      "        else:\n            hi = mid - 1\n"
                      "    return -1\n",
                      [("while lo <= hi:", "while lo < hi:"), ("lo = mid + 1", "lo = mid"),
                       ("(lo + hi) // 2", "(lo + hi) / 2")]),
    "greet": ("def greet(name):\n    return f\"Hello, {name}!\"\n", [("f\"Hello, {name}!\"", "\"Hello, {name}!\""),
                                                                   ("return f", "print(f")]),
    "read_numbers": ("def read_numbers(path):\n    with open(path) as f:\n"
                     "        return [int(line) for line in f if line.strip()]\n",
                     [("if line.strip()", ""), ("with open(path) as f:", "with open(path, \"w\") as f:")]),
    "word_lengths": ("def word_lengths(words):\n    return {w: len(w) for w in words}\n",
                     [("{w: len(w) for w in words}", "{len(w): w for w in words}")]),
    "clamp": ("def clamp(x, low, high):\n    return max(low, min(x, high))\n",
              [("max(low, min(x, high))", "min(low, max(x, high))"),
               ("max(low, min(x, high))", "max(low, min(x, low))")]),
    "merge_lists": ("def merge_lists(a, b):\n    result = a.copy()\n    result.extend(b)\n    return result\n",
                    [("result = a.copy()", "result = a"), ("result.extend(b)", "result.append(b)")]),
    "countdown": ("def countdown(n):\n    while n > 0:\n        print(n)\n        n -= 1\n    print(\"Liftoff!\")\n",
                  [("n -= 1", "n += 1"), ("while n > 0:", "while n > 0\n")]),
    "safe_divide": ("def safe_divide(a, b):\n    try:\n        return a / b\n    except ZeroDivisionError:\n"
                    "        return None\n",
                    [("except ZeroDivisionError:", "except ValueError:"), ("return a / b", "return a // b")]),
    "unique": ("def unique(items):\n    seen = set()\n    out = []\n    for x in items:\n        if x not in seen:\n"
               "            seen.add(x)\n            out.append(x)\n    return out\n",
               [("            seen.add(x)\n", ""), ("if x not in seen:", "if x in seen:")]),
    "square_all": ("def square_all(numbers):\n    return [n ** 2 for n in numbers]\n",
                   [("n ** 2", "n * 2"), ("n ** 2", "n ^ 2")]),
    "is_leap_year": ("def is_leap_year(year):\n    return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)\n",
                     [("(year % 100 != 0 or year % 400 == 0)", "year % 100 != 0"),
                      ("year % 4 == 0 and", "year % 4 == 0 or")]),
    "get_initials": ("def get_initials(full_name):\n"
                     "    return \"\".join(part[0].upper() for part in full_name.split())\n",
                     [("part[0]", "part[1]"), ("full_name.split()", "full_name")]),
}
FIX_TEMPLATES = [
    "Fix the bug in this Python function:\n\n```python\n{code}```",
    "This function does not work as expected. What is wrong, and how do I fix it?\n\n```python\n{code}```",
    "Find the mistake in this code and give the corrected version.\n\n```python\n{code}```",
]
TEST_TEMPLATES = [
    "Write pytest unit tests for this function:\n\n```python\n{code}```",
    "Write a few unittest test cases for the following Python function.\n\n```python\n{code}```",
]
SNIPPET_EXPLAIN = ["What does this Python function do?\n\n```python\n{code}```",
                   "Add comments to this code that explain each step.\n\n```python\n{code}```"]

# Functions drawn from the standard library: explain / complete / document.
STDLIB_MODULES = [
    "textwrap", "shlex", "fnmatch", "posixpath", "string", "heapq", "bisect", "statistics", "fractions",
    "colorsys", "calendar", "difflib", "ipaddress", "glob", "functools", "copy", "pprint", "base64", "html/__init__",
    "urllib/parse", "random", "datetime", "collections/__init__", "json/encoder", "json/decoder", "csv", "gettext",
    "keyword", "numbers", "operator", "quopri", "reprlib", "sched", "shutil", "tempfile", "uu", "wave",
    "zipfile", "graphlib", "email/utils", "http/cookies", "mimetypes", "netrc", "optparse", "platform", "smtplib",
    "tokenize", "traceback", "typing", "uuid", "webbrowser", "getopt", "genericpath", "ntpath", "locale",
    "contextlib", "dataclasses", "enum", "inspect", "linecache", "pathlib", "secrets", "configparser", "argparse",
]
STDLIB_MIN_LINES, STDLIB_MAX_LINES, STDLIB_MAX_CHARS = 5, 22, 900
STDLIB_EXPLAIN = [
    "Explain what this function from Python's `{module}` module does:\n\n```python\n{code}\n```",
    "Here is a function from the Python standard library (`{module}`). Walk me through how it works.\n\n"
    "```python\n{code}\n```",
    "What is the purpose of this code, and when would I use it?\n\n```python\n{code}\n```",
]
STDLIB_COMPLETE = "Complete this Python function so that it does what its docstring says:\n\n```python\n{code}\n```"
STDLIB_DOCSTRING = "Write a docstring for this Python function:\n\n```python\n{code}\n```"


@dataclass(frozen=True)
class StdlibFunction:
    module: str  # dotted
    qualname: str
    source: str  # dedented, docstring included
    header: str  # signature + docstring
    without_docstring: str


@lru_cache(maxsize=None)
def stdlib_functions(stdlib_dir: str | None = None) -> tuple[StdlibFunction, ...]:
    """Documented public functions and methods of `STDLIB_MODULES` whose source is short enough for a prompt."""
    root = Path(stdlib_dir or sysconfig.get_paths()["stdlib"])
    found: list[StdlibFunction] = []
    for rel in STDLIB_MODULES:
        path = root / f"{rel}.py"
        if not path.is_file():
            continue
        source = path.read_text(encoding="utf-8", errors="replace")
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        lines = source.splitlines()
        module = rel.replace("/__init__", "").replace("/", ".")
        for owner, node in _functions(tree):
            doc = ast.get_docstring(node, clean=False)
            if node.name.startswith("_") or doc is None or not node.body[1:]:
                continue
            start = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
            body = lines[start:node.end_lineno]
            if not STDLIB_MIN_LINES <= len(body) <= STDLIB_MAX_LINES:
                continue
            text = textwrap.dedent("\n".join(body))
            if len(text) > STDLIB_MAX_CHARS or "\t" in text:
                continue
            doc_node = node.body[0]
            header = textwrap.dedent("\n".join(lines[start:doc_node.end_lineno]))
            kept = lines[start:doc_node.lineno - 1] + lines[doc_node.end_lineno:node.end_lineno]
            qualname = f"{owner}.{node.name}" if owner else node.name
            found.append(StdlibFunction(module, qualname, text, header, textwrap.dedent("\n".join(kept))))
    return tuple(found)


def _functions(tree: ast.Module) -> Iterator[tuple[str | None, ast.FunctionDef]]:
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            yield None, node
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    yield node.name, item


def code_prompts() -> Iterator[Prompt]:
    for name, task in FUNCTION_TASKS:
        s = f"task:{name}"
        for suffix in FUNCTION_SUFFIXES:
            yield Prompt("code.write_function", s, f"Write a Python function that {task}.{suffix}")
            yield Prompt("code.write_function", s, f"Write a Python function `{name}` that {task}.{suffix}")
        yield Prompt("code.write_function", s,
                     f"I need Python code that {task}. Can you write it and explain it briefly?")
        yield Prompt("code.unit_test", s, f"Write pytest tests for a function `{name}` that {task}.")
    for h in HOWTOS:
        for t in HOWTO_TEMPLATES:
            yield Prompt("code.howto", f"howto:{h}", t.format(h=h))
    for name, (good, bugs) in SNIPPETS.items():
        s = f"snippet:{name}"
        for old, new in bugs:
            if old not in good:
                raise AssertionError(f"snippet {name}: {old!r} not in its source")
            buggy = good.replace(old, new, 1)
            for t in FIX_TEMPLATES:
                yield Prompt("code.fix_bug", s, t.format(code=buggy))
        for t in TEST_TEMPLATES:
            yield Prompt("code.unit_test", s, t.format(code=good))
        for t in SNIPPET_EXPLAIN:
            yield Prompt("code.explain", s, t.format(code=good))
    for fn in stdlib_functions():
        s = f"stdlib:{fn.module}.{fn.qualname}"
        for t in STDLIB_EXPLAIN:
            yield Prompt("code.explain_stdlib", s, t.format(module=fn.module, code=fn.source))
        yield Prompt("code.complete_stdlib", s, STDLIB_COMPLETE.format(code=fn.header))
        yield Prompt("code.docstring_stdlib", s, STDLIB_DOCSTRING.format(code=fn.without_docstring))
        if "." not in fn.qualname:  # plain functions only: a method needs its class to be tested
            yield Prompt("code.unit_test", s, TEST_TEMPLATES[0].format(code=fn.source + "\n"))


# =====================================================================================================================
# structured
# =====================================================================================================================
ENTITIES = {
    "book": ("a fictional book", ["title", "author", "year", "genre", "pages", "rating"]),
    "person": ("an imaginary person", ["name", "age", "city", "occupation", "hobbies", "email"]),
    "city": ("a made-up city", ["name", "country", "population", "founded", "landmarks", "climate"]),
    "recipe": ("a simple recipe", ["name", "servings", "prep_time_minutes", "ingredients", "steps", "vegetarian"]),
    "product": ("a product in an online store", ["id", "name", "price", "currency", "in_stock", "tags"]),
    "movie": ("a movie", ["title", "director", "year", "genres", "duration_minutes", "cast"]),
    "event": ("a community event", ["name", "date", "location", "organizer", "capacity", "free"]),
    "car": ("a car for sale", ["make", "model", "year", "mileage_km", "price", "color"]),
    "planet": ("a fictional planet",
               ["name", "radius_km", "moons", "has_atmosphere", "surface_temperature_c", "discovered_by"]),
    "job": ("a job posting", ["title", "company", "location", "salary_range", "remote", "requirements"]),
    "student": ("a student record", ["student_id", "name", "grade", "courses", "gpa", "enrolled"]),
    "song": ("a song", ["title", "artist", "album", "year", "duration_seconds", "genre"]),
    "restaurant": ("a restaurant", ["name", "cuisine", "address", "rating", "price_level", "open_hours"]),
    "flight": ("a flight", ["flight_number", "origin", "destination", "departure_time", "arrival_time", "seats_left"]),
    "pet": ("a pet", ["name", "species", "breed", "age_years", "vaccinated", "owner"]),
    "task": ("a to-do item", ["id", "title", "due_date", "priority", "done", "tags"]),
    "user": ("a user account", ["username", "email", "created_at", "is_admin", "last_login", "preferences"]),
    "order": ("a customer order", ["order_id", "customer", "items", "total", "status", "shipping_address"]),
    "hotel": ("a hotel", ["name", "stars", "city", "price_per_night", "amenities", "rooms_available"]),
    "course": ("an online course", ["title", "instructor", "duration_hours", "level", "topics", "price"]),
    "company": ("a startup company", ["name", "founded", "industry", "employees", "headquarters", "products"]),
    "weather": ("a weather report", ["city", "date", "temperature_c", "humidity", "conditions", "wind_kmh"]),
    "device": ("a smartphone", ["brand", "model", "storage_gb", "battery_mah", "release_year", "colors"]),
    "game": ("a video game", ["title", "studio", "release_year", "platforms", "genre", "multiplayer"]),
    "paper": ("a research paper", ["title", "authors", "year", "venue", "keywords", "citations"]),
    "plant": ("a houseplant", ["common_name", "latin_name", "light", "watering_days", "pet_safe", "max_height_cm"]),
    "transaction": ("a bank transaction", ["id", "date", "amount", "currency", "merchant", "category"]),
    "ticket": ("a support ticket", ["ticket_id", "customer", "subject", "priority", "status", "created_at"]),
    "museum": ("a museum", ["name", "city", "opening_year", "collections", "ticket_price", "open_days"]),
    "server": ("a server configuration", ["hostname", "ip_address", "os", "cpu_cores", "memory_gb", "services"]),
}
JSON_OBJECT_TEMPLATES = [
    "Return a JSON object with the fields {fields} describing {desc}. Output only the JSON.",
    "Create a JSON object for {desc} with these keys: {fields}.",
    "Generate example data for {desc} as JSON with the fields {fields}. Do not add any explanation.",
]
JSON_ARRAY_TEMPLATE = "Create a JSON array of {n} entries, each {desc} with the fields {fields}."
TABLE_TEMPLATE = "Make a markdown table with the columns {fields} and {n} rows, each row describing {desc}."
YAML_TEMPLATE = "Write {desc} as YAML with the keys {fields}."
CITIES = ["Paris", "Tokyo", "Nairobi", "Lima", "Oslo", "Toronto", "Mumbai", "Sydney", "Cairo", "Berlin", "Seoul",
          "Mexico City", "Lisbon", "Istanbul", "Bangkok", "Chicago"]
JOBS = ["nurse", "software engineer", "teacher", "chef", "architect", "pilot", "accountant", "photographer",
        "electrician", "biologist", "journalist", "firefighter"]
EXTRACT_TEMPLATES = [
    "Extract the name, age, job and city from this text and return them as JSON: \"{text}\"",
    "Read the sentence and output a JSON object with the keys \"name\", \"age\", \"job\" and \"city\".\n\n{text}",
]
EVENT_EXTRACT = "Extract the event name, date, time and place from this message as JSON: \"{text}\""
EVENTS = ["the book club", "a team offsite", "the science fair", "a charity run", "the piano recital",
          "the product demo", "a farewell party", "the board meeting"]
REVIEWS_GOOD = ["works perfectly and arrived early", "is the best purchase I made this year",
                "exceeded my expectations", "is well made and easy to use"]
REVIEWS_BAD = ["stopped working after two days", "was smaller than described", "arrived broken",
               "is too loud and the battery dies fast"]
REVIEWS_MIXED = ["looks great but is a bit expensive", "is fine, although setup took an hour",
                 "does the job but the instructions are confusing"]
SENTIMENT_TEMPLATE = ("Classify the sentiment of this review as positive, negative or neutral, and answer with "
                      "JSON like {{\"sentiment\": ..., \"reason\": ...}}: \"{text}\"")
TOOLS = {
    "get_weather": ("get_weather(city: str, unit: str = \"celsius\")", [
        "get the weather in {city}", "find out how hot it is in {city} in fahrenheit",
        "check tomorrow's weather in {city}"]),
    "send_email": ("send_email(to: str, subject: str, body: str)", [
        "email {person} at {person_l}@example.com that the meeting moved to {time}",
        "send {person} ({person_l}@example.com) a thank-you note"]),
    "create_event": ("create_event(title: str, date: str, start_time: str, duration_minutes: int)", [
        "schedule a {minutes}-minute call called \"{event}\" on {date} at {time}",
        "add {event} to my calendar on {date} at {time} for {minutes} minutes"]),
    "convert_currency": ("convert_currency(amount: float, from_currency: str, to_currency: str)", [
        "convert {amount} US dollars to euros", "how much is {amount} yen in British pounds"]),
    "search_products": ("search_products(query: str, max_price: float, sort_by: str)", [
        "find {product} under ${amount}, cheapest first", "search for {product} with a maximum price of {amount}"]),
    "set_timer": ("set_timer(minutes: int, label: str)", [
        "set a {minutes}-minute timer for the pasta", "remind me in {minutes} minutes to stretch"]),
    "translate_text": ("translate_text(text: str, target_language: str)", [
        "translate \"good morning, everyone\" into {language}", "say \"where is the station?\" in {language}"]),
    "get_stock_price": ("get_stock_price(symbol: str, exchange: str = \"NASDAQ\")", [
        "get the current price of {symbol}", "what is {symbol} trading at on the NYSE"]),
    "book_table": ("book_table(restaurant: str, people: int, date: str, time: str)", [
        "book a table for {people} at Luigi's on {date} at {time}",
        "reserve dinner for {people} people at Sakura on {date}, {time}"]),
    "calculate_tip": ("calculate_tip(bill_amount: float, tip_percent: float)", [
        "work out a {tip}% tip on a ${amount} bill", "how much should I tip on ${amount} at {tip} percent"]),
    "get_directions": ("get_directions(origin: str, destination: str, mode: str)", [
        "directions from {city} airport to the city center by train",
        "how do I walk from the museum to the station in {city}"]),
    "add_todo": ("add_todo(title: str, due_date: str, priority: str)", [
        "add \"{event}\" to my to-do list for {date}, high priority", "remind me to prepare {event} by {date}"]),
    "play_music": ("play_music(artist: str, shuffle: bool)", [
        "play some {artist} on shuffle", "put on {artist}, no shuffle"]),
    "lookup_word": ("lookup_word(word: str, language: str)", [
        "look up the meaning of \"{word}\" in English", "what does \"{word}\" mean"]),
}
TOOL_TEMPLATE = ("You can call this function:\n{sig}\n\nRespond with only a JSON object of the form "
                 "{{\"name\": ..., \"arguments\": {{...}}}} to {request}.")
TOOL_FILL = {
    "person": ["Alice", "Bob", "Chen", "Dana", "Elif", "Femi"], "time": ["3 pm", "10:30", "noon", "9 am"],
    "minutes": ["15", "30", "45", "10", "5"],
    "event": ["Quarterly review", "Design sync", "the team lunch", "Sprint planning"],
    "date": ["2025-03-14", "next Monday", "June 2", "2025-11-20"], "amount": ["50", "120", "19.99", "2500", "75"],
    "product": ["running shoes", "a desk lamp", "wireless earbuds", "a rice cooker"],
    "language": ["Spanish", "Japanese", "German", "Italian"], "symbol": ["AAPL", "MSFT", "NVDA", "IBM"],
    "people": ["2", "4", "6", "3"], "tip": ["15", "18", "20"], "artist": ["Miles Davis", "Queen", "Adele", "Bach"],
    "word": ["serendipity", "ephemeral", "ubiquitous", "candid"],
}


def _fields(names: list[str]) -> str:
    quoted = [f"\"{n}\"" for n in names]
    return ", ".join(quoted[:-1]) + f" and {quoted[-1]}" if len(quoted) > 1 else quoted[0]


_PEOPLE_FIELDS = ("name", "author", "owner", "customer", "director", "artist", "instructor", "organizer")
_PLACE_FIELDS = ("city", "location", "origin", "destination", "headquarters", "country", "address")
_NUMBER_HINTS = ("year", "age", "price", "pages", "population", "founded", "servings", "minutes", "hours", "km",
                 "mileage", "capacity", "moons", "rating", "total", "amount", "gb", "mah", "employees", "stars",
                 "seconds", "citations", "gpa", "grade", "cores", "night", "humidity", "temperature", "seats", "id")


def _csv_value(field: str, row: int, rng: random.Random) -> str:
    """A plausible CSV cell for a column named `field` (people, places, numbers, flags; else a labelled value)."""
    if field in _PEOPLE_FIELDS:
        return _pick(rng, NAMES)[0]
    if field in _PLACE_FIELDS:
        return _pick(rng, CITIES)
    if "date" in field or field.endswith("_at"):
        return f"2024-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    if field in ("in_stock", "free", "remote", "vaccinated", "enrolled", "done", "vegetarian", "multiplayer",
                 "is_admin", "has_atmosphere", "pet_safe"):
        return _pick(rng, ["true", "false"])
    if any(h in field for h in _NUMBER_HINTS):
        return str(rng.randint(1, 2000) if "year" not in field and "founded" not in field else rng.randint(1950, 2024))
    return f"{field.replace('_', ' ')} {row}"


def _fill(template: str, rng: random.Random) -> str:
    values = {k: _pick(rng, v) for k, v in TOOL_FILL.items()}
    values["city"] = _pick(rng, CITIES)
    values["person_l"] = values["person"].lower()
    return template.format(**values)


def structured_prompts(rng: random.Random) -> Iterator[Prompt]:
    for key, (desc, fields) in ENTITIES.items():
        s = f"entity:{key}"
        subsets = [fields[:k] for k in (3, 4, 5, 6)]
        subsets += [sorted(rng.sample(fields, 4), key=fields.index) for _ in range(4)]
        for sub in subsets:
            for t in JSON_OBJECT_TEMPLATES:
                yield Prompt("structured.json_object", s, t.format(fields=_fields(sub), desc=desc))
            yield Prompt("structured.yaml", s, YAML_TEMPLATE.format(fields=_fields(sub), desc=desc))
            for n in (2, 3):
                yield Prompt("structured.json_array", s, JSON_ARRAY_TEMPLATE.format(n=n, desc=f"describing {desc}",
                                                                                    fields=_fields(sub[:4])))
                yield Prompt("structured.table", s,
                             TABLE_TEMPLATE.format(fields=", ".join(sub[:4]), n=n + 1, desc=desc))
        header = fields[:4]
        rows = [",".join(_csv_value(h, i, rng) for h in header) for i in range(1, 4)]
        csv_text = "\n".join([",".join(header), *rows])
        yield Prompt("structured.convert", s, f"Convert this CSV to a JSON array of objects:\n\n{csv_text}")
        yield Prompt("structured.convert", s,
                     f"Turn this CSV into JSON, one object per row, and output only the JSON:\n\n{csv_text}")
    for i in range(120):
        (name, _pronoun), age, job, city = _pick(rng, NAMES), rng.randint(19, 70), _pick(rng, JOBS), _pick(rng, CITIES)
        text = rng.choice([f"{name} is a {age}-year-old {job} who lives in {city}.",
                           f"Meet {name}: {age} years old, working as a {job} in {city}.",
                           f"After years abroad, {name} ({age}) now works as a {job} in {city}."])
        yield Prompt("structured.extract", f"extract:{text}", _pick(rng, EXTRACT_TEMPLATES).format(text=text))
    for i in range(60):
        event, city = _pick(rng, EVENTS), _pick(rng, CITIES)
        date, time = _pick(rng, TOOL_FILL["date"]), _pick(rng, TOOL_FILL["time"])
        text = rng.choice([f"Reminder: {event} is on {date} at {time} at the {city} office.",
                           f"Hi all, {event} will take place on {date}, starting at {time}, in {city}. See you there!"])
        yield Prompt("structured.extract", f"extract:{text}", EVENT_EXTRACT.format(text=text))
    products = ["headphones", "blender", "backpack", "phone case", "lamp", "keyboard", "kettle", "tent"]
    for p in products:
        for pool in (REVIEWS_GOOD, REVIEWS_BAD, REVIEWS_MIXED):
            for r in pool:
                text = f"This {p} {r}."
                yield Prompt("structured.sentiment", f"review:{text}", SENTIMENT_TEMPLATE.format(text=text))
    for name, (sig, requests) in TOOLS.items():
        for request in requests:
            for _ in range(6):
                text = TOOL_TEMPLATE.format(sig=sig, request=_fill(request, rng))
                yield Prompt("structured.tool_call", f"tool:{name}", text)


# =====================================================================================================================
# assembly
# =====================================================================================================================
def _normalize(text: str) -> str:
    return re.sub(r"\s+", " ", text.strip().lower())


def _candidates(category: str, rng: random.Random) -> list[Prompt]:
    sources: dict[str, Callable[[], Iterator[Prompt]]] = {
        "chat": chat_prompts, "lists": list_prompts, "writing": writing_prompts, "math": lambda: math_prompts(rng),
        "code": code_prompts, "structured": lambda: structured_prompts(rng),
    }
    return list(sources[category]())


def _reserve(prompts: list[Prompt], fraction: float, rng: random.Random) -> set[str]:
    """A seeded `fraction` of each subject pool (the part of a subject before ':'), at least one per pool."""
    pools: dict[str, set[str]] = {}
    for p in prompts:
        pools.setdefault(p.subject.split(":", 1)[0], set()).add(p.subject)
    reserved: set[str] = set()
    for name in sorted(pools):
        subjects = sorted(pools[name])
        if len(subjects) < 2:
            continue
        rng.shuffle(subjects)
        reserved.update(subjects[:max(1, round(fraction * len(subjects)))])
    return reserved


def _round_robin(prompts: list[Prompt], count: int, rng: random.Random, seen: set[str],
                 one_per_subject: bool = False) -> list[Prompt]:
    """`count` prompts, one template at a time in turn (templates shuffled, instances shuffled), skipping texts in
    `seen` (updated). With `one_per_subject`, each subject is used once before any is used again."""
    by_template: dict[str, list[Prompt]] = {}
    for p in prompts:
        by_template.setdefault(p.template, []).append(p)
    queues = []
    for name in sorted(by_template):
        items = by_template[name][:]
        rng.shuffle(items)
        if one_per_subject:  # order: first instance of every subject, then second ones, ...
            rank: dict[str, int] = {}
            keyed = []
            for p in items:
                keyed.append((rank.get(p.subject, 0), len(keyed), p))
                rank[p.subject] = rank.get(p.subject, 0) + 1
            items = [p for _, _, p in sorted(keyed, key=lambda t: t[:2])]
        queues.append(items)
    rng.shuffle(queues)
    chosen: list[Prompt] = []
    positions = [0] * len(queues)
    while len(chosen) < count and any(pos < len(q) for pos, q in zip(positions, queues)):
        for i, q in enumerate(queues):
            while positions[i] < len(q):
                p = q[positions[i]]
                positions[i] += 1
                key = _normalize(p.text)
                if key not in seen:
                    seen.add(key)
                    chosen.append(p)
                    break
            if len(chosen) == count:
                break
    if len(chosen) < count:
        raise ValueError(f"only {len(chosen)} distinct prompts available, {count} requested "
                         f"(templates: {sorted(by_template)})")
    return chosen


def build_prompts(seed: int = DEFAULT_SEED, train_counts: dict[str, int] | None = None,
                  heldout_counts: dict[str, int] | None = None) -> tuple[list[Prompt], list[Prompt]]:
    """(train, heldout): deterministic for a given seed and standard library (module docstring)."""
    train_counts = TRAIN_COUNTS if train_counts is None else train_counts
    heldout_counts = HELDOUT_COUNTS if heldout_counts is None else heldout_counts
    unknown = sorted(set(train_counts) - set(CATEGORIES)) + sorted(set(heldout_counts) - set(CATEGORIES))
    if unknown:
        raise ValueError(f"unknown categories {unknown}; valid: {list(CATEGORIES)}")
    train: list[Prompt] = []
    heldout: list[Prompt] = []
    seen: set[str] = set()
    for category in CATEGORIES:
        rng = random.Random(f"clover-smol:{seed}:{category}")
        pool = _candidates(category, rng)
        reserved = _reserve(pool, HELDOUT_FRACTION, rng) if heldout_counts.get(category) else set()
        if heldout_counts.get(category):
            held_pool = [p for p in pool if p.subject in reserved]
            heldout += _round_robin(held_pool, heldout_counts[category], rng, seen, one_per_subject=True)
        if train_counts.get(category):
            train_pool = [p for p in pool if p.subject not in reserved]
            train += _round_robin(train_pool, train_counts[category], rng, seen)
    random.Random(f"clover-smol:{seed}:order").shuffle(train)
    return train, heldout


def write_jsonl(prompts: list[Prompt], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for p in prompts:
            f.write(json.dumps(p.row(), ensure_ascii=False) + "\n")
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="directory for train.jsonl and heldout.jsonl")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help=f"default {DEFAULT_SEED}")
    parser.add_argument("--scale", type=float, default=1.0,
                        help="multiply the train counts (the pools allow up to about 3.5; held-out is fixed)")
    args = parser.parse_args(argv)
    counts = {c: round(n * args.scale) for c, n in TRAIN_COUNTS.items()}
    train, heldout = build_prompts(args.seed, train_counts=counts)
    write_jsonl(train, args.out / "train.jsonl")
    write_jsonl(heldout, args.out / "heldout.jsonl")
    for name, rows in (("train", train), ("heldout", heldout)):
        counts: dict[str, int] = {}
        for p in rows:
            counts[p.category] = counts.get(p.category, 0) + 1
        print(f"{name}: {len(rows)} prompts {counts} -> {args.out / (name + '.jsonl')}")
    print(f"seed {args.seed}, scale {args.scale}, Python {sys.version.split()[0]} "
          f"(stdlib functions: {len(stdlib_functions())})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
