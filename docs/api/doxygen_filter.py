#!/usr/bin/env python3
"""Doxygen input filter: ferry's headers document themselves in plain // comments (the
way the rest of the code reads); this turns them into Doxygen's without editing them.
  - the comment block at the top of a header (before #pragma once) becomes the file's page
    (its first paragraph the brief, less the "ferry/x.hpp: " in front);
  - a // block directly above a declaration becomes that declaration's documentation;
  - a trailing // after a member declaration (`int x = 0;  // why`) becomes its ///<;
  - a declaration of several names (`float lr, beta1, beta2;`), documented either way,
    documents each of them (Doxygen would give the text to the first or the last only).
Line numbers are kept (one output line per input line), so warnings point at the header."""
import os
import re
import sys


def code_chars(line):
    """(offset, char, in_literal) for each char of a line of code: in_literal is true inside
    a string or character literal (escapes included); a digit separator (1'000) is none."""
    quote, escaped = None, False
    for k, c in enumerate(line):
        if quote:
            yield k, c, True
            if escaped:
                escaped = False
            elif c == '\\':
                escaped = True
            elif c == quote:
                quote = None
        else:
            if c in '"\'' and not (c == "'" and k > 0 and line[k - 1].isalnum()):
                quote = c
                yield k, c, True
            else:
                yield k, c, False


def comment_start(line):
    """Where a trailing // comment starts in a line of code, outside string and character
    literals (`const char* kind = "";  // why`); None when there is none."""
    for k, c, lit in code_chars(line):
        if not lit and line.startswith('//', k):
            return k
    return None


def escape(text):
    """Plain comment text, not Doxygen markup: outside `code spans`, a backslash, an
    @, a # or an angle bracket is text (vector<int>, "\\r", #include)."""
    parts = text.split('`')
    for k in range(0, len(parts), 2):  # even parts lie outside code spans
        parts[k] = re.sub(r'([\\@#<>%])', r'\\\1', parts[k])
        parts[k] = re.sub(r'(?<![\w>])::(?=\w)', r'\\::', parts[k])  # "::name" is no link
    return '`'.join(parts)


DECLARATOR = re.compile(r'^\s*[*&]*\w+(\[\w*\])?\s*(=.*|\{.*\})?\s*;?\s*$')


def top_level_commas(code):
    """Offsets of the commas of `code` outside brackets, template arguments and literals."""
    depth, out = 0, []
    for k, c, lit in code_chars(code):
        if lit:
            continue
        if c in '([{<':
            depth += 1
        elif c in ')]}' or (c == '>' and code[k - 1] != '-'):
            depth -= 1
        elif c == ',' and depth == 0:
            out.append(k)
    return out if depth == 0 else []


def several_names(code, text, above=False):
    """`float a = 0, b = 0;` with its doc text: each name documented inline (/**< */), as
    Doxygen documents only one name of a declaration: the last (a trailing comment) or,
    when the text was `above` it, the first; None when `code` is not one."""
    s = code.strip()
    if not s.endswith(';') or re.match(r'(return|using|typedef|friend|template|#)\b', s):
        return None
    commas = top_level_commas(code)
    if not commas:
        return None
    parts = [code[a + 1:b] for a, b in zip([-1] + commas, commas + [len(code)])]
    if '(' in parts[0].split('=')[0] or not all(DECLARATOR.match(x) for x in parts[1:]):
        return None
    doc = ' /**< ' + text.replace('*/', '* /') + ' */'
    tail = parts[-1]
    if above:
        end = tail.rindex(';')
        tail = tail[:end].rstrip() + doc + tail[end:]
    return ''.join(x + ('' if above and k == 0 else doc) + ',' for k, x in enumerate(parts[:-1])) + tail


def main(path):
    with open(path, encoding='utf-8') as f:
        lines = f.read().split('\n')
    out = []
    in_header = True  # the leading block, up to #pragma once
    header_started = False
    for i, line in enumerate(lines):
        s = line.lstrip()
        if in_header:
            if s.startswith('#pragma once'):
                in_header = False
                out.append(line)
                continue
            if s.startswith('//'):
                body = s[2:]
                if body.startswith(' '):
                    body = body[1:]
                if not header_started:
                    header_started = True
                    # "ferry/x.hpp: what it is": \file, then its description, in one block
                    # (a separate `/** \file */` would leave the text to the namespace after
                    # it). \file's name is a word: the absolute path, unambiguous.
                    name = os.path.abspath(path)
                    name = name if not re.search(r'\s', name) else os.path.basename(path)
                    text = escape(body.split(': ', 1)[-1] if ': ' in body else body)
                    out.append('//! \\file ' + name + ' \\brief ' + text)
                else:
                    out.append('//! ' + escape(body))
                continue
            out.append(line)
            continue
        if s.startswith('//') and not s.startswith('///') and not s.startswith('//!'):
            # A block directly above a declaration (the next non-comment line is code).
            j = i + 1
            while j < len(lines) and lines[j].lstrip().startswith('//'):
                j += 1
            nxt = lines[j].strip() if j < len(lines) else ''
            # (a #define is documented too; other preprocessor lines are not declarations)
            if nxt and (not nxt.startswith('#') or re.match(r'#\s*define\b', nxt)) and not nxt.startswith('}'):
                out.append(line[:len(line) - len(s)] + '///' + escape(s[2:]))
                continue
            out.append(line)
            continue
        at = comment_start(line) if s and not s.startswith('//') else None
        if at is not None and line[:at].rstrip().endswith(';') and line[at - 1:at].isspace():
            code, gap = line[:at].rstrip(), line[len(line[:at].rstrip()):at]
            text = line[at + 2:]
            text = escape(text[1:] if text.startswith(' ') else text)
            out.append((several_names(code, text) or code) + gap + '///< ' + text)
            continue
        # Several names under a // block: the block is the first one's; the rest get it inline.
        k = i - 1
        while k >= 0 and lines[k].lstrip().startswith('//') and not lines[k].lstrip().startswith('///'):
            k -= 1
        if k < i - 1 and s and not s.startswith('//'):
            above = ' '.join(x.lstrip()[2:].strip() for x in lines[k + 1:i])
            code = several_names(line, escape(above), above=True)
            if code:
                out.append(code)
                continue
        out.append(line)
    sys.stdout.write('\n'.join(out))


if __name__ == '__main__':
    main(sys.argv[1])
