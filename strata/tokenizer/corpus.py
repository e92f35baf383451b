"""A few KB of plain English that the synthetic vocabularies learn their merges from.

Written for Strata; any text would do. It only has to be fixed (the merges must be the same on every
run) and varied enough that common words, spaces, digits, punctuation and a little code get merges.
"""

CORPUS = """\
The river runs past the old mill and under the stone bridge before it reaches the town.
In the morning the market opens early, and the farmers bring bread, cheese, apples and eggs.
Children walk to school along the water, and their teachers wait for them at the gate.
It is a small town, but it has a library, a theatre, two bakeries and a very busy station.
Trains leave every hour for the city, which is about forty minutes away on the fast line.

When the weather is good, people sit outside the cafe and talk about the news of the day.
Some of them read the paper; others look at their phones or watch the boats on the river.
The owner of the cafe knows everyone by name. He has worked there for more than thirty years,
and he says that the secret of good coffee is patience, clean water and fresh beans.

A model reads text as a sequence of tokens. Each token is a number that stands for a piece of
a word, a whole word, a space, or a mark such as a comma or a full stop. The tokenizer turns the
text into those numbers, and the model predicts the next number, one step at a time. When the
model is done, the numbers are turned back into text, which should be exactly what was written.

Experts in a mixture of experts are small feed forward networks. For every token, a router picks
a few of them, and only those experts do any work for that token. This is why a very large model
can run quickly: most of its weights are not used for any single step. The hard part is memory,
because all of the experts must still live somewhere, and moving them is slow.

Here is a short program that counts the words in a file:

def count_words(path):
    counts = {}
    with open(path) as handle:
        for line in handle:
            for word in line.split():
                counts[word] = counts.get(word, 0) + 1
    return counts

if __name__ == "__main__":
    result = count_words("notes.txt")
    for word, number in sorted(result.items()):
        print(word, number)

The numbers in the report were 12, 345, 6789 and 2024. The total was 1,234,567 and the
average was 3.14 per day. On the 1st of May, 25% of the tickets cost $10 and the rest cost $15.
Call 555-0100 between 9:00 and 17:30, or write to the office at 42 Station Road.

"Don't worry," she said. "We'll be there before it's dark, and you're going to love it."
He didn't answer at first. Then he smiled, picked up his bag, and followed her to the door.
They'd walked this road many times, but tonight it felt different: quieter, and a little cold.
I can't remember who said it, but I've always liked the line: what we learn, we keep.

Questions and answers:
Q: What is the capital of France?
A: The capital of France is Paris.
Q: How many days are there in a week?
A: There are seven days in a week.
Q: Why is the sky blue?
A: Sunlight is scattered by the air, and blue light is scattered more than red light.

The system starts, loads the model, and waits for a request. A request holds a list of messages,
each with a role and some content: the system, the user, or the assistant. The template writes
them out as one prompt, the prompt becomes tokens, and the tokens go through the layers. Then the
sampler picks the next token, the text is printed, and the loop goes on until a stop token comes.

Good tests are small, fast and exact. They compare the result with a reference that someone else
wrote, and they say clearly what went wrong when the two do not agree. A test that passes for the
wrong reason is worse than no test at all, so it is worth checking that it can fail.

Notes for the next release:
- faster loading of large files
- better error messages for missing fields
- support for more chat templates
- fewer copies of the weights in memory

The end of the day comes slowly in summer. The light stays long after dinner, the birds sing,
and the river turns gold and then grey. Somewhere a dog barks, a door closes, and the town
settles down for the night. Tomorrow the market will open again, and the trains will run.
"""
