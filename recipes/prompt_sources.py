"""Synthetic prompt sources for the reference drafter's mix (``reference_prompts.py``): code, maths, follow-ups.

None of these is copied from a benchmark set:

* **code**: functions from the Python standard library of the machine that writes the
  mix (``ast``-extracted, 4-30 lines), each with a task (explain, document, test, review,
  rewrite), plus "write a function that ..." tasks in several languages;
* **maths**: multi-step word problems from templates with random numbers (GSM8K's style,
  none of its text), and bare arithmetic, algebra and unit questions;
* **follow-ups**: second user turns ("Now make it shorter", "Explain step 2") so that the
  mix has two-turn conversations, as MT-Bench does.
"""

from __future__ import annotations

import ast
import random
import sysconfig
from pathlib import Path

CODE_TASKS = (
    "Explain what this Python function does:\n\n```python\n{code}\n```",
    "Write a docstring for this function:\n\n```python\n{code}\n```",
    "Write two unit tests for this function using pytest:\n\n```python\n{code}\n```",
    "Review this code. Is there anything you would change?\n\n```python\n{code}\n```",
    "Rewrite this function so that it is easier to read:\n\n```python\n{code}\n```",
    "What does this function return? Describe its inputs and outputs.\n\n```python\n{code}\n```",
    "Add comments to this code:\n\n```python\n{code}\n```",
    "Summarize this function in one sentence, then explain it line by line.\n\n```python\n{code}\n```",
)
WRITE_TASKS = (
    "reverses a string",
    "checks whether a number is prime",
    "computes the factorial of n",
    "sorts a list of numbers without using sort()",
    "counts the words in a sentence",
    "finds the largest element in a list",
    "returns the Fibonacci numbers below n",
    "checks whether a word is a palindrome",
    "merges two sorted lists",
    "removes duplicates from a list while keeping the order",
    "converts Celsius to Fahrenheit",
    "computes the average of a list",
    "counts the vowels in a string",
    "finds the second largest number in a list",
    "flattens a nested list",
    "checks whether two strings are anagrams",
    "computes the greatest common divisor of two numbers",
    "reads a text file and counts its lines",
    "implements binary search",
    "parses a date string like 2024-03-15",
    "validates an email address",
    "finds the most common word in a text",
    "transposes a matrix",
    "rotates a list by k positions",
    "computes the running sum of a list",
    "groups words by their first letter",
    "converts a number to Roman numerals",
    "checks whether parentheses in a string are balanced",
    "returns the n-th row of Pascal's triangle",
    "computes the distance between two points",
    "shuffles a list",
    "capitalizes the first letter of every word",
    "finds all pairs in a list that sum to a target",
    "implements a stack with push and pop",
    "implements a queue using two stacks",
    "counts the frequency of each character",
    "computes compound interest",
    "checks whether a year is a leap year",
    "generates a random password",
    "merges two dictionaries",
)
LANGUAGES = ("Python", "Python", "Python", "JavaScript", "C", "Java", "Go", "Rust", "SQL-free Python", "TypeScript")
WRITE_TEMPLATES = (
    "Write a {language} function that {task}.",
    "Write a {language} function that {task}, with a docstring and an example.",
    "How would you write a program in {language} that {task}?",
    "Explain how to write a function that {task}, then write it in {language}.",
    "Write a {language} function that {task}, and explain its time complexity.",
)
NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Gus", "Hana", "Ivan", "Jade", "Kofi", "Lena", "Mateo", "Nia")
ITEMS = ("apples", "books", "stickers", "marbles", "cookies", "pencils", "cards", "shells", "stamps", "coins")
WORD_PROBLEMS = (
    "{n1} has {a} {item}. {n2} has {b} more than {n1}. How many {item} do they have together?",
    "{n1} buys {a} {item} at ${b} each and pays with a ${c} bill. How much change does {n1} get?",
    "A class has {a} students. {b} of them walk to school and the rest take the bus. If {c} more students "
    "join and all of them take the bus, how many take the bus?",
    "{n1} reads {a} pages a day. How many days does it take to finish a book of {d} pages?",
    "A farmer has {a} rows of trees with {b} trees in each row. He sells {c} trees. How many are left?",
    "{n1} saves ${a} every week. After {b} weeks {n1} spends ${c}. How much money is left?",
    "A recipe needs {a} eggs for {b} people. How many eggs are needed for {d} people?",
    "{n1} runs {a} km on Monday, twice as far on Tuesday and {b} km on Wednesday. How far did {n1} run in total?",
    "A shop sold {a} {item} in the morning and {b} fewer in the afternoon. How many did it sell that day?",
    "{n1} and {n2} share {d} {item} so that {n1} gets {a} more than {n2}. How many does each get?",
    "A car uses {a} liters of fuel per 100 km. How much fuel does it need for {d} km?",
    "A movie starts at {h}:15 and lasts {a} minutes. At what time does it end?",
    "A box holds {a} {item}. How many boxes are needed for {d} {item}?",
    "The price of a jacket is ${d}. It is on sale for {p}% off. What is the sale price?",
    "{n1} is {a} years old. {n2} is {b} years older. How old will {n2} be in {c} years?",
)
BARE_MATHS = (
    "What is {a} times {b}? Show your work.",
    "What is {d} divided by {a}?",
    "Solve for x: {a}x + {b} = {d}.",
    "What is {p}% of {d}?",
    "Convert {d} minutes to hours and minutes.",
    "What is the area of a circle with radius {a} cm?",
    "A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
    "Is {d} a prime number? Explain.",
    "What is the least common multiple of {a} and {b}?",
    "Simplify the fraction {b}/{d}.",
    "What is the average of {a}, {b} and {c}?",
    "If a train travels {d} km in {a} hours, what is its average speed?",
)
MATH_SUFFIXES = ("", " Reason step by step.", " Explain your answer.", " Show your work.")
FOLLOWUPS = (
    "Now make your answer shorter.",
    "Can you explain that in simpler words?",
    "Rewrite your previous answer as a list of bullet points.",
    "Give me one more example.",
    "What is the most important point in your answer?",
    "Now write it in a more formal tone.",
    "Can you add a short conclusion?",
    "Explain the second point in more detail.",
    "Turn your answer into a short poem.",
    "Summarize your answer in one sentence.",
    "What would a critic say about your answer?",
    "Translate the first sentence of your answer into French.",
)


def code_snippets(limit: int, rng: random.Random, min_lines: int = 4, max_lines: int = 30) -> list[str]:
    """Up to ``limit`` distinct functions of the standard library, 4-30 lines, without nested definitions."""
    root = Path(sysconfig.get_paths()["stdlib"])
    snippets = []
    for path in sorted(root.glob("*.py")):
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        lines = source.splitlines()
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or node.end_lineno is None:
                continue
            body = lines[node.lineno - 1 : node.end_lineno]
            nested = any(isinstance(n, (ast.FunctionDef, ast.ClassDef)) for n in ast.walk(node) if n is not node)
            if min_lines <= len(body) <= max_lines and not nested and all(line.isascii() for line in body):
                indent = len(body[0]) - len(body[0].lstrip())
                snippets.append("\n".join(line[indent:] for line in body))
    snippets = sorted(set(snippets))
    rng.shuffle(snippets)
    return snippets[:limit]


def code_records(count: int, rng: random.Random) -> list[dict]:
    """Half tasks about real functions (explain, document, test, review), half "write a function that ..."."""
    if count <= 0:
        return []  # draws nothing: the mixes written without code prompts stay as they were
    snippets = code_snippets(count // 2, rng)
    records = [{"turns": [rng.choice(CODE_TASKS).format(code=code)]} for code in snippets]
    while len(records) < count:
        template = rng.choice(WRITE_TEMPLATES)
        records.append({"turns": [template.format(language=rng.choice(LANGUAGES), task=rng.choice(WRITE_TASKS))]})
    return records


def maths_records(count: int, rng: random.Random) -> list[dict]:
    """Word problems (two thirds) and bare questions with random numbers."""
    records = []
    for n in range(count):
        names = rng.sample(NAMES, 2)
        values = dict(
            a=rng.randint(2, 60),
            b=rng.randint(2, 40),
            c=rng.randint(1, 30),
            d=rng.randint(60, 900),
            p=rng.choice((5, 10, 15, 20, 25, 30, 40, 50)),
            h=rng.randint(1, 11),
            n1=names[0],
            n2=names[1],
            item=rng.choice(ITEMS),
        )
        template = rng.choice(WORD_PROBLEMS if n % 3 else BARE_MATHS)
        records.append({"turns": [template.format(**values) + rng.choice(MATH_SUFFIXES)]})
    return records


def with_followups(records: list[dict], fraction: float, rng: random.Random) -> list[dict]:
    """A second user turn on ``fraction`` of the records (answered after the target's own first answer)."""
    if fraction <= 0:
        return records  # draws nothing: the mixes written without follow-ups stay as they were
    for record in records:
        if rng.random() < fraction:
            record["turns"] = record["turns"][:1] + [rng.choice(FOLLOWUPS)]
    return records


MORE_TOPICS = tuple(
    topic.strip()
    for topic in """
artificial intelligence; the French language; baking bread; marathon training; the Amazon river;
ancient Egypt; quantum computing; birdwatching; the periodic table; electric guitars; urban planning;
the theory of evolution; cybersecurity; origami; mountain climbing; whales; the Industrial Revolution;
nuclear power; composting; the history of pizza; solar panels; first aid; the Silk Road; cloud computing;
yoga; the human brain; tornadoes; libraries; street food; the Beatles; budget travel; houseplants;
cryptography; the Vikings; ocean tides; autumn; a haunted lighthouse; a time traveler; a talking tree;
a detective in Paris; a lost spaceship; a village festival; a young inventor; an old map; a friendly ghost;
the Arctic; coral reefs; the Mona Lisa; space tourism; 3D printing; e-mail etiquette; writing a resume;
negotiating a salary; starting a small business; learning to swim; playing the piano; photography;
climate adaptation; wildfires; water conservation; public transport; the history of money; board games;
podcasts; minimalism; procrastination; habits; teamwork; leadership; kindness; curiosity; failure; success;
creativity; the scientific method; statistics; probability; algebra; geometry; the Pythagorean theorem;
prime numbers; fractions; percentages; the metric system; the speed of light; magnetism; electricity;
sound waves; rainbows; the seasons; the carbon cycle; cells; DNA; bacteria; viruses; nutrition; exercise;
stress; hydration; the Olympic marathon; football; tennis; cricket; basketball; skiing; camping;
hiking safety; fishing; bees and flowers; wolves; elephants; octopuses; cats; dogs; horses; owls;
butterflies; ants; sharks; dolphins; the Eiffel Tower; the pyramids; Machu Picchu; Venice; Tokyo;
New York City; the Sahara; Antarctica; the Himalayas; the Nile; the Pacific Ocean; the Moon; Mars; Jupiter;
comets; the Big Bang; telescopes; satellites; GPS; the telephone; the light bulb; airplanes; trains; ships;
rockets; clocks; calendars; maps; alphabets; poetry; novels; theater; opera; movies; cartoons; museums;
architecture; fashion; chocolate; spices; rice; cheese; olive oil; honey; tea ceremonies; farming;
fishing villages; markets; trade; taxes; banks; insurance; credit cards; investing; retirement; elections;
human rights; the law
""".replace("\n", " ").split(";")
)
MORE_TEMPLATES = (
    "What are three surprising facts about {topic}?",
    "Write a short speech about {topic}.",
    "Explain why {topic} matters today.",
    "Write a tweet about {topic}.",
    "What are the main causes and effects related to {topic}?",
    "Write a FAQ with three questions about {topic}.",
    "Describe a typical day of someone who works with {topic}.",
    "Give a beginner's guide to {topic}.",
    "Write a short fairy tale involving {topic}.",
    "What are common mistakes people make with {topic}?",
    "Write a motivational message inspired by {topic}.",
    "Explain {topic} using an analogy.",
    "Write a quiz with four questions about {topic}, with answers.",
    "Tell me a fun story about {topic} for children.",
    "What is the history of {topic} in five sentences?",
    "Write a diary entry about {topic}.",
    "Describe the future of {topic} in 2050.",
    "What would you tell a friend who wants to learn about {topic}?",
    "Write a riddle about {topic} and give the answer.",
    "Explain the connection between {topic} and {other}.",
    "Write a short advertisement for a course on {topic}.",
    "List five words associated with {topic} and explain each.",
    "Write a letter to your future self about {topic}.",
    "Argue for and against {topic} in two short paragraphs.",
)
