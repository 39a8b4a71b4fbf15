"""The seed instructions a draft is distilled from: written for this project, never taken from a benchmark.

They cover what chat users ask (stories, explanations, code, lists, translation, summaries of given text,
questions and answers, reasoning, rewriting, role play, extraction, arithmetic word problems), built by
combining task templates with topics so that a few hundred lines of text give thousands of distinct
instructions. Tasks that work on a given text (summarise, translate, rewrite, answer from passages,
extract) take that text from the target's own first-round answers: see `text_tasks`.
"""

from __future__ import annotations

import random

TOPICS = [
    "the water cycle",
    "black holes",
    "photosynthesis",
    "the French Revolution",
    "machine learning",
    "climate change",
    "the human immune system",
    "volcanoes",
    "the Roman Empire",
    "electric cars",
    "honey bees",
    "the stock market",
    "quantum computing",
    "the Great Wall of China",
    "vaccines",
    "renewable energy",
    "the printing press",
    "coral reefs",
    "the internet",
    "sleep",
    "inflation",
    "the Moon landing",
    "plate tectonics",
    "democracy",
    "antibiotics",
    "the Silk Road",
    "rainforests",
    "social media",
    "the Renaissance",
    "DNA",
    "recycling",
    "earthquakes",
    "jazz music",
    "the Olympic Games",
    "solar panels",
    "the industrial revolution",
    "meditation",
    "cryptocurrency",
    "dinosaurs",
    "coffee",
    "the Amazon river",
    "nuclear power",
    "chess",
    "the theory of evolution",
    "remote work",
    "tea ceremonies",
    "the ancient Egyptians",
    "3D printing",
    "bird migration",
    "public libraries",
    "the periodic table",
    "gravity",
    "urban gardening",
    "video games",
    "the Cold War",
    "sharks",
    "language learning",
    "artificial sweeteners",
    "the Mars rovers",
    "ocean tides",
    "the history of money",
    "bicycles",
    "mountain climbing",
    "the human brain",
    "fermentation",
    "wind turbines",
    "the Byzantine Empire",
    "volunteering",
    "smartphones",
    "the Arctic",
    "baking bread",
    "the speed of light",
    "Shakespeare",
    "microplastics",
    "time management",
    "the Vikings",
    "electric guitars",
    "compound interest",
    "glaciers",
    "the Mayan civilisation",
    "public transport",
    "butterflies",
    "cloud computing",
    "the Beatles",
    "deserts",
    "first aid",
    "the history of aviation",
    "composting",
    "robots",
    "the Nile",
    "origami",
    "hurricanes",
    "a healthy breakfast",
    "starting a small business",
    "learning to swim",
    "job interviews",
    "saving money",
    "planting a vegetable garden",
    "writing a resume",
    "public speaking",
    "moving to a new city",
    "camping",
]

CHARACTERS = [
    "a lonely robot",
    "a young wizard",
    "a retired detective",
    "a curious cat",
    "a ship's captain",
    "a baker in a small village",
    "an astronaut on Mars",
    "a talking tree",
    "a shy dragon",
    "twin sisters",
    "a street musician",
    "an old lighthouse keeper",
    "a time traveller",
    "a lost puppy",
    "a school teacher",
    "a knight who is afraid of the dark",
    "a gardener",
    "a programmer",
    "a farmer during a drought",
    "a pirate",
]

SETTINGS = [
    "in a futuristic city",
    "on a stormy night",
    "in a quiet mountain village",
    "at the bottom of the sea",
    "in a busy train station",
    "during a snowstorm",
    "in an enchanted forest",
    "on a space station",
    "in a desert oasis",
    "in a haunted library",
    "at a summer festival",
    "in ancient Rome",
]

LANGUAGES = ["French", "Spanish", "German", "Italian", "Portuguese", "Chinese", "Japanese", "Russian"]

CODE_TASKS = [
    "reverses a string",
    "checks whether a number is prime",
    "returns the n-th Fibonacci number",
    "counts the words in a text",
    "sorts a list of dictionaries by a key",
    "merges two sorted lists",
    "finds the largest element in a list",
    "removes duplicates from a list while keeping order",
    "converts Celsius to Fahrenheit",
    "checks whether a string is a palindrome",
    "computes a factorial",
    "reads a CSV file and prints the average of a column",
    "validates an email address",
    "flattens a nested list",
    "counts how often each character appears in a string",
    "implements binary search",
    "returns the greatest common divisor of two numbers",
    "transposes a matrix",
    "groups words that are anagrams of each other",
    "computes a moving average",
    "parses a date string and returns the weekday",
    "implements a stack class",
    "finds the median of a list",
    "generates all permutations of a list",
    "checks whether brackets in a string are balanced",
    "converts a Roman numeral to an integer",
    "implements a simple LRU cache",
    "computes the dot product",
]

CODE_LANGUAGES = ["Python", "Python", "Python", "JavaScript", "C", "Java", "Go", "Rust", "SQL", "Bash"]

PEOPLE = ["Anna", "Ben", "Carlos", "Dana", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jamal", "Kim", "Liam"]
ITEMS = ["apples", "pencils", "books", "cookies", "stickers", "marbles", "tickets", "oranges", "coins", "cards"]

OPINIONS = [
    "cities should ban cars from their centres",
    "homework should be optional",
    "remote work is here to stay",
    "everyone should learn to code",
    "space exploration is worth its cost",
    "social media does more harm than good",
    "museums should be free",
    "a four-day work week is better",
    "school uniforms are useful",
]

RIDDLES = [
    "If all bloops are razzies and all razzies are lazzies, are all bloops lazzies? Explain.",
    "A bat and a ball cost $1.10 in total. The bat costs $1.00 more than the ball. How much is the ball?",
    "Which is heavier, a kilogram of feathers or a kilogram of iron? Explain your answer.",
    "If it takes 5 machines 5 minutes to make 5 widgets, how long do 100 machines take to make 100 widgets?",
    "Tom is taller than Sue, and Sue is taller than Max. Who is the shortest? Explain.",
    "A farmer has 17 sheep and all but 9 run away. How many are left?",
    "If today is Wednesday, what day will it be 100 days from now? Show your reasoning.",
    "There are three boxes, one with apples, one with oranges and one with both, all labelled wrongly. "
    "You may take one fruit from one box. How do you label them correctly?",
    "A clock shows 3:15. What is the angle between the hour hand and the minute hand?",
    "You have two ropes that each burn in exactly one hour, but unevenly. How can you measure 45 minutes?",
]


def _topic_tasks(rng: random.Random) -> str:
    topic = rng.choice(TOPICS)
    n = rng.choice([3, 4, 5, 5, 6, 7, 10])
    templates = [
        f"Explain {topic} to a ten-year-old.",
        f"Explain {topic} in simple terms.",
        f"What is the most important thing to know about {topic}?",
        f"Give me {n} interesting facts about {topic}.",
        f"List {n} tips for someone interested in {topic}.",
        f"Write a short blog post about {topic}.",
        f"Write a persuasive paragraph about why people should care about {topic}.",
        f"What are the advantages and disadvantages of {topic}?",
        f"Describe the history of {topic} in a few paragraphs.",
        f"Write a haiku about {topic}.",
        f"Write a short poem about {topic}.",
        f"Create a quiz with {n} questions about {topic}, with answers.",
        f"How would you teach a class about {topic}? Give a lesson plan.",
        f"Write an email to a friend recommending a book about {topic}.",
        f"Compare {topic} and {rng.choice(TOPICS)}. How are they similar and how are they different?",
        f"What are common misconceptions about {topic}?",
        f"Summarize what scientists know about {topic}.",
        f"Write a tweet about {topic}.",
        f"Why is {topic} important? Answer in one paragraph.",
        f"Write a product description for an educational kit about {topic}.",
        f"Give a step-by-step guide related to {topic}.",
        f"Write a short dialogue between a teacher and a student about {topic}.",
        f"What questions should I ask an expert on {topic}?",
        f"Describe {topic} as if you were a tour guide.",
    ]
    return rng.choice(templates)


def _story(rng: random.Random) -> str:
    who, where = rng.choice(CHARACTERS), rng.choice(SETTINGS)
    templates = [
        f"Write a short story about {who} {where}.",
        f"Tell me a bedtime story about {who}.",
        f"Write the opening paragraph of a novel about {who} {where}.",
        f"Write a funny story about {who} who finds something unexpected {where}.",
        f"Write a story in exactly five sentences about {who}.",
        f"Write a diary entry by {who} {where}.",
        f"Write a letter from {who} to their best friend.",
        f"Pretend you are {who} {where}. Describe your day.",
        f"You are {who}. Introduce yourself to a new neighbour.",
        f"Write a scene {where} with a surprising twist at the end.",
    ]
    return rng.choice(templates)


def _code(rng: random.Random) -> str:
    task, lang = rng.choice(CODE_TASKS), rng.choice(CODE_LANGUAGES)
    templates = [
        f"Write a {lang} function that {task}.",
        f"Write a {lang} function that {task}, and explain how it works.",
        f"How do I write code in {lang} that {task}?",
        f"Write a {lang} program that {task}. Add comments.",
        f"Write unit tests for a {lang} function that {task}.",
        f"What is the time complexity of a function that {task}? Show an example in {lang}.",
        f"Explain what a {rng.choice(['for loop', 'class', 'dictionary', 'recursion', 'closure', 'pointer'])} "
        f"is in {lang}, with an example.",
    ]
    return rng.choice(templates)


def _math(rng: random.Random) -> str:
    a, b, c = rng.randint(2, 60), rng.randint(2, 30), rng.randint(2, 12)
    p, q = rng.sample(PEOPLE, 2)
    item = rng.choice(ITEMS)
    templates = [
        f"{p} has {a} {item}. {q} gives {p} {b} more, and then {p} shares them equally among {c} friends. "
        f"How many does each friend get? Show your work.",
        f"A shop sells {item} at ${c} each. {p} buys {a} of them and pays with ${a * c + b}. "
        f"How much change does {p} get?",
        f"What is {a} times {b} plus {c}? Explain step by step.",
        f"Solve for x: {c}x + {b} = {c * a + b}.",
        f"A train travels at {a + 20} km/h for {c} hours. How far does it go?",
        f"{p} reads {b} pages a day. How many days does a {a * b + c}-page book take?",
        f"What is {b}% of {a * 10}?",
        f"The sum of two numbers is {a + b} and their difference is {abs(a - b)}. What are the numbers?",
        f"A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
        f"{p} is {a} years old and {q} is {c} years younger. How old will {q} be in {b} years?",
        f"If a pizza is cut into {c} slices and {p} eats {min(c - 1, 3)}, what fraction is left?",
        f"Is {a * b + 1} a prime number? Explain how you checked.",
        f"Calculate the average of {a}, {b}, {c} and {a + b}.",
        rng.choice(RIDDLES),
    ]
    return rng.choice(templates)


def _misc(rng: random.Random) -> str:
    lang = rng.choice(LANGUAGES)
    templates = [
        f"Argue for and against the claim that {rng.choice(OPINIONS)}.",
        f"Write a short essay on whether {rng.choice(OPINIONS)}.",
        f"How do you say 'good morning, how are you?' in {lang}?",
        f"Teach me ten basic words in {lang}.",
        f"What are the main differences between English and {lang}?",
        "Plan a three-day trip to " + rng.choice(["Paris", "Tokyo", "Rome", "New York", "Cairo", "Lisbon"]) + ".",
        "Give me a healthy recipe for dinner with " + rng.choice(["rice", "lentils", "chicken", "tofu", "pasta"]) + ".",
        "What should I pack for a week of " + rng.choice(["hiking", "beach holidays", "skiing", "city travel"]) + "?",
        "Write a polite email asking my manager for a day off.",
        "Write a thank-you note to a teacher.",
        "How can I improve my " + rng.choice(["sleep", "focus", "writing", "memory", "cooking", "handwriting"]) + "?",
        "What is the difference between " + " and ".join(rng.sample(TOPICS, 2)) + "?",
        "Who was "
        + rng.choice(
            [
                "Marie Curie",
                "Albert Einstein",
                "Ada Lovelace",
                "Leonardo da Vinci",
                "Nelson Mandela",
                "Isaac Newton",
                "Cleopatra",
                "Charles Darwin",
            ]
        )
        + "?",
        "What is the capital of " + rng.choice(["France", "Japan", "Brazil", "Canada", "Kenya", "Australia"]) + "?",
        "Describe the rules of " + rng.choice(["chess", "football", "tennis", "basketball", "poker", "go"]) + ".",
        "Act as a "
        + rng.choice(["travel agent", "career coach", "fitness trainer", "chef", "librarian"])
        + " and give me advice.",
    ]
    return rng.choice(templates)


_FIRST_ROUND = [(_topic_tasks, 4), (_story, 2), (_code, 2), (_math, 2), (_misc, 2)]


def seed_instructions(n: int, seed: int = 0) -> list[str]:
    """`n` distinct self-contained instructions, the same for the same seed."""
    rng = random.Random(seed)
    makers = [m for m, w in _FIRST_ROUND for _ in range(w)]
    out: list[str] = []
    seen: set[str] = set()
    attempts = 0
    while len(out) < n and attempts < 50 * n:
        attempts += 1
        text = rng.choice(makers)(rng)
        if text not in seen:
            seen.add(text)
            out.append(text)
    return out


def text_tasks(passages: list[str], n: int, seed: int = 0) -> list[str]:
    """`n` instructions that work on given text (summaries, translation, rewriting, answering from passages,
    extraction), built from `passages`: the target's own answers to the first round."""
    rng = random.Random(seed)
    usable = [p.strip() for p in passages if 200 <= len(p.strip()) <= 1500]
    if not usable:
        return []
    out: list[str] = []
    for _ in range(n):
        text = rng.choice(usable)
        first = " ".join(text.split(". ")[:2]).strip()
        lang = rng.choice(LANGUAGES)
        templates = [
            f"Summarize the following text in two sentences:\n\n{text}",
            f"Summarize the following text:\n\n{text}",
            f"Write a one-sentence summary of this passage:\n\n{text}",
            f"Give the key points of this text as a bullet list:\n\n{text}",
            f"Translate into {lang}:\n\n{first}",
            f"Translate the following sentence to {lang}: {first}",
            f"Rewrite the following text in a more formal tone:\n\n{text}",
            f"Rewrite this so a child can understand it:\n\n{text}",
            f"Fix any grammar mistakes and improve the style of this text:\n\n{text}",
            f"Extract all names, places and numbers from this text as JSON:\n\n{text}",
            f"What is the main idea of this passage?\n\n{text}",
            f"Write three questions about this text and answer them:\n\n{text}",
            f"Using only the passage below, answer: what is it mainly about?\n\nPassage: {text}",
            "Read the documents and answer the question.\n\nDocument 1: "
            + text
            + "\n\nDocument 2: "
            + rng.choice(usable)
            + "\n\nQuestion: What do the two documents have in common?",
            f"Continue this text with one more paragraph:\n\n{text}",
            f"Write a title for this text:\n\n{text}",
        ]
        out.append(rng.choice(templates))
    return out
