"""The seed instructions a draft is distilled from: written for this project, never taken from a benchmark.

They cover what chat users ask (stories, explanations, code, lists, translation, summaries of given text,
questions and answers, reasoning, rewriting, role play, extraction, arithmetic word problems), built by
combining task templates with topics so that a few hundred lines of text give thousands of distinct
instructions. Tasks that work on a given text (summarise, translate, rewrite, answer from passages,
extract) take that text from the target's own first-round answers: see `text_tasks`.
"""

from __future__ import annotations

import random
from collections.abc import Callable

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
    return _draw(_FIRST_ROUND, n, seed)


def _draw(kinds: list[tuple[Callable[[random.Random], str], int]], n: int, seed: int) -> list[str]:
    """`n` distinct instructions from the weighted makers `kinds`, in the order drawn (so the first m of a
    longer list are the list of m)."""
    rng = random.Random(seed)
    makers = [m for m, w in kinds for _ in range(w)]
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


# --- Traffic-like instructions ------------------------------------------------------------------------------
# What people send a chat server beside self-contained requests: short factual questions, word problems that want
# their steps, text in another language to translate, long articles to summarise or answer from, second turns
# that build on the first answer. Every text here was written for this project.

FACT_QUESTIONS = [
    "who invented the {thing}",
    "when was the {thing} invented",
    "what is the {thing} used for",
    "how does a {thing} work",
    "where was the first {thing} built",
    "why is the {thing} important",
    "what is the difference between a {thing} and a {other}",
    "how many parts does a {thing} have",
]

THINGS = [
    "telephone",
    "light bulb",
    "steam engine",
    "microscope",
    "bicycle",
    "compass",
    "telescope",
    "radio",
    "refrigerator",
    "printing press",
    "airplane",
    "camera",
    "thermometer",
    "battery",
    "calculator",
    "clock",
    "sewing machine",
    "elevator",
    "washing machine",
    "vaccine",
    "satellite",
    "submarine",
    "windmill",
    "piano",
]

PLACES = [
    "Mount Everest",
    "the Sahara desert",
    "Lake Victoria",
    "the Nile",
    "Iceland",
    "the Andes",
    "Madagascar",
    "Antarctica",
    "the Mediterranean Sea",
    "Siberia",
    "the Great Barrier Reef",
    "the Alps",
    "Patagonia",
]

PLACE_QUESTIONS = [
    "where is {place}",
    "how big is {place}",
    "what animals live in {place}",
    "what is the climate like in {place}",
    "who first explored {place}",
    "why is {place} famous",
]

# Sentences to translate, written for this project (German, French, Spanish, Italian, Portuguese).
FOREIGN = {
    "German": [
        "Das Wetter ist heute sehr schön, deshalb gehen wir in den Park.",
        "Die Stadt plant eine neue Brücke über den Fluss, die im nächsten Jahr fertig sein soll.",
        "Mein Bruder arbeitet seit drei Jahren als Koch in einem kleinen Restaurant.",
        "Die Regierung hat neue Regeln für den Verkehr in der Innenstadt beschlossen.",
        "Viele Schüler lernen Englisch als erste Fremdsprache.",
        "Der Zug nach Berlin hat heute zwanzig Minuten Verspätung.",
        "Wir müssen mehr tun, um die Umwelt zu schützen und Energie zu sparen.",
        "Das Museum zeigt eine Ausstellung über die Geschichte der Seefahrt.",
        "Nach dem Regen war die Luft frisch und die Straßen glänzten.",
        "Die Firma hat im letzten Quartal mehr Gewinn gemacht als erwartet.",
        "Ich habe das Buch gestern Abend zu Ende gelesen und es hat mir gut gefallen.",
        "Die Forscher haben eine neue Art von Frosch im Regenwald entdeckt.",
    ],
    "French": [
        "Le marché du samedi attire beaucoup de monde dans le centre du village.",
        "Les enfants ont construit un château de sable sur la plage.",
        "La bibliothèque sera fermée pendant deux semaines pour des travaux.",
        "Le nouveau gouvernement veut réduire les impôts des petites entreprises.",
        "Il faut environ trois heures pour aller de Paris à Marseille en train.",
        "Les scientifiques étudient l'effet du climat sur les oiseaux migrateurs.",
        "Elle a appris à jouer du piano quand elle avait six ans.",
        "Le festival de musique a lieu chaque année au début de l'été.",
    ],
    "Spanish": [
        "El equipo ganó el partido en el último minuto gracias a un gol increíble.",
        "Mi abuela prepara la mejor paella de toda la familia.",
        "El ayuntamiento abrirá un nuevo parque en el barrio el próximo mes.",
        "Los precios de la vivienda han subido mucho en las grandes ciudades.",
        "Durante el verano, muchas personas viajan a la costa para descansar.",
        "La empresa busca ingenieros con experiencia en energía solar.",
        "El médico recomienda caminar treinta minutos todos los días.",
        "Los estudiantes presentaron sus proyectos de ciencias en la feria.",
    ],
    "Italian": [
        "Il ristorante in fondo alla strada serve la pizza più buona della città.",
        "Domani mattina partiamo presto per evitare il traffico.",
        "Il museo ha ricevuto in dono una collezione di quadri antichi.",
        "Gli agricoltori sperano che la pioggia arrivi presto.",
    ],
    "Portuguese": [
        "A praia estava cheia de turistas durante o feriado.",
        "O novo hospital vai atender milhares de pessoas por ano.",
        "Ela estuda medicina na universidade e quer ser pediatra.",
        "O festival de cinema apresenta filmes de vários países.",
    ],
}

FOLLOW_UPS = [
    "Can you make that shorter?",
    "Now rewrite your answer for a ten-year-old.",
    "Can you give me an example?",
    "Explain the second point in more detail.",
    "Summarize your answer in one sentence.",
    "Turn your answer into a bullet list.",
    "What would be a good title for this?",
    "Now write it in a more formal tone.",
    "Can you add two more ideas?",
    "What are the weaknesses of your answer?",
    "Translate your answer into {lang}.",
    "Now write a short poem based on your answer.",
    "Are you sure? Please check your answer again.",
    "How would you explain this to an expert?",
    "Give me three questions to test my understanding of this.",
    "Rewrite it as an email to my team.",
]


def _question(rng: random.Random) -> str:
    if rng.random() < 0.6:
        text = rng.choice(FACT_QUESTIONS).format(thing=rng.choice(THINGS), other=rng.choice(THINGS))
    else:
        text = rng.choice(PLACE_QUESTIONS).format(place=rng.choice(PLACES))
    # Search-box questions arrive in lower case about as often as capitalised.
    return text + "?" if rng.random() < 0.5 else text[0].upper() + text[1:] + "?"


def _word_problem(rng: random.Random) -> str:
    a, b, c, d = rng.randint(3, 40), rng.randint(2, 25), rng.randint(2, 9), rng.randint(5, 90)
    p, q = rng.sample(PEOPLE, 2)
    item = rng.choice(ITEMS)
    problems = [
        f"{p} buys {a} {item} on Monday and twice as many on Tuesday. On Wednesday {p} gives {b} of them to {q}. "
        f"How many {item} does {p} have left?",
        f"A bakery makes {a * c} muffins a day and sells them in boxes of {c}. Each box costs ${b}. "
        f"How much money does the bakery make in a week if it sells every box?",
        f"{p} earns ${d} a day and works {c} days a week. {p} spends ${b * c} a week on food and saves the rest. "
        f"How much does {p} save in {a % 8 + 2} weeks?",
        f"A school has {a} classes with {b} students each. {c} students in every class take the bus. "
        f"How many students do not take the bus?",
        f"{p} is reading a book with {a * 10 + d} pages. {p} read {b} pages yesterday and twice as many today. "
        f"How many pages are left?",
        f"A garden is {a} meters long and {b} meters wide. Fencing costs ${c} per meter. "
        f"How much does it cost to fence the whole garden?",
        f"{q} had {d} {item}. {q} lost a quarter of them and then bought {b} more. How many does {q} have now?",
    ]
    text = rng.choice(problems)
    return text + rng.choice(["", "", " Let's think step by step.", " Show your work.", " Explain your reasoning."])


def _translation(rng: random.Random) -> str:
    lang = rng.choice(list(FOREIGN))
    sentence = rng.choice(FOREIGN[lang])
    templates = [
        f"Translate {lang} to English: {sentence}",
        f"Translate into English:\n\n{sentence}",
        f"What does this mean in English? {sentence}",
        f"Translate the following {lang} sentence into English and explain any difficult words: {sentence}",
    ]
    return rng.choice(templates)


_TRAFFIC_ROUND = [*_FIRST_ROUND, (_question, 2), (_word_problem, 2), (_translation, 1)]


def traffic_instructions(n: int, seed: int = 0) -> list[str]:
    """`n` distinct self-contained instructions of the kinds chat traffic holds: the seed instructions' kinds
    plus short factual questions, multi-step word problems and text in other languages to translate. The same
    for the same seed, and the first `m` of a longer list are the list of `m` (a later run extends a corpus)."""
    return _draw(_TRAFFIC_ROUND, n, seed)


Conversation = list[dict[str, str]]


def follow_ups(pairs: list[tuple[str, str]], n: int, seed: int = 0) -> list[Conversation]:
    """`n` two-turn conversations: a first instruction and the target's answer to it (`pairs`), then a second
    user turn that works on that answer."""
    rng = random.Random(seed)
    usable = [(q, a.strip()) for q, a in pairs if 40 <= len(a.strip()) <= 2000]
    out: list[Conversation] = []
    for _ in range(n if usable else 0):
        question, answer = rng.choice(usable)
        second = rng.choice(FOLLOW_UPS).format(lang=rng.choice(LANGUAGES))
        out.append(
            [
                {"role": "user", "content": question},
                {"role": "assistant", "content": answer},
                {"role": "user", "content": second},
            ]
        )
    return out


def long_passage_tasks(passages: list[str], n: int, seed: int = 0) -> list[str]:
    """`n` summarising and answering tasks over long inputs: articles of two to five of `passages` (the target's
    own answers) joined, as news summaries and retrieval-augmented questions arrive."""
    rng = random.Random(seed)
    usable = [p.strip() for p in passages if 200 <= len(p.strip()) <= 1500]
    out: list[str] = []
    for _ in range(n if len(usable) >= 5 else 0):
        parts = rng.sample(usable, rng.randint(2, 5))
        article = "\n\n".join(parts)
        question = rng.choice(
            [
                "What is the main topic of these documents?",
                "Which facts are mentioned in more than one document?",
                "What does the first document say?",
                "List the numbers that appear in the documents and what they refer to.",
                "Which document is the most useful for a student, and why?",
            ]
        )
        templates = [
            f"Summarize the following article:\n\n{article}",
            f"{article}\n\nSummarize the text above in a few sentences.",
            f"Write a short news summary of this article:\n\n{article}",
            f"Answer the question using the documents below.\n\n{article}\n\nQuestion: {question}",
            f"{article}\n\nBased on the passages above, {question[0].lower() + question[1:]}",
        ]
        out.append(rng.choice(templates))
    return out
