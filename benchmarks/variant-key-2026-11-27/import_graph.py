"""Module import graph of a crate's src/ (file = module), from `use crate::..`, `crate::..` paths
and `super::`; prints strongly connected components of more than one file."""
import os, re, sys, collections
root = sys.argv[1]
files = {}
for d, _, fs in os.walk(root):
    for f in fs:
        if f.endswith('.rs'):
            p = os.path.join(d, f)
            rel = os.path.relpath(p, root)[:-3]
            parts = rel.split('/')
            if parts[-1] in ('mod', 'lib'):
                parts = parts[:-1]
            files['::'.join(parts)] = p
mods = set(files)
def resolve(path):
    # longest module prefix of a crate path
    segs = path.split('::')
    for n in range(len(segs), -1, -1):
        m = '::'.join(segs[:n])
        if m in mods:
            return m
    return None
edges = collections.defaultdict(set)
for m, p in files.items():
    src = open(p).read()
    src = re.sub(r'#\[cfg\(test\)\]\s*mod tests\s*\{.*', '', src, flags=re.S)
    src = re.sub(r'//[^\n]*', '', src)
    for mo in re.finditer(r'crate::([A-Za-z_][A-Za-z0-9_:]*)', src):
        t = resolve(mo.group(1).rstrip(':'))
        if t is not None and t != m and not m.startswith(t + '::') and t != '':
            edges[m].add(t)
    parent = m.rsplit('::', 1)[0] if '::' in m else ''
    is_dir = p.endswith('mod.rs')
    base = m if is_dir else parent
    # expand `super::{a, b::c}` groups into `super::a`, `super::b::c`
    def expand(mo):
        inner = mo.group(2)
        return ' '.join(mo.group(1) + part.strip() + ';' for part in inner.split(',') if part.strip())
    src = re.sub(r'(\bsuper::(?:super::)*)\{([^{}]*)\}', expand, src)
    for mo in re.finditer(r'\bsuper::((?:super::)*)([A-Za-z_][A-Za-z0-9_:]*|\*|\{)', src):
        ups = mo.group(1).count('super::') + 1
        b = m.split('::') if m else []
        b = b[:len(b) - ups] if not is_dir else b[:len(b) - ups]
        name = mo.group(2)
        target_base = '::'.join(b)
        if name in ('*', '{'):
            t = target_base
        else:
            t = resolve((target_base + '::' if target_base else '') + name.rstrip(':')) or target_base
        if t != m and t is not None and not m.startswith(t + '::') or (name == '*' and t != m):
            edges[m].add(t)
    # A directory module's references to its children (`child::item`, `use child::..`).
    if is_dir:
        for mo in re.finditer(r'(?<![A-Za-z0-9_:])([a-z_][a-z0-9_]*)::', src):
            child = (m + '::' if m else '') + mo.group(1)
            if child in mods and mo.group(1) not in ('crate', 'super', 'self', 'std', 'wgpu'):
                edges[m].add(child)
# Tarjan
index = {}; low = {}; stack = []; on = set(); sccs = []; i = [0]
def strong(v):
    index[v] = low[v] = i[0]; i[0] += 1; stack.append(v); on.add(v)
    for w in edges.get(v, ()):
        if w not in index:
            strong(w); low[v] = min(low[v], low[w])
        elif w in on:
            low[v] = min(low[v], index[w])
    if low[v] == index[v]:
        c = []
        while True:
            w = stack.pop(); on.discard(w); c.append(w)
            if w == v: break
        sccs.append(c)
sys.setrecursionlimit(10000)
for v in sorted(mods):
    if v not in index: strong(v)
big = [c for c in sccs if len(c) > 1]
print(f'{len(mods)} modules, {sum(len(e) for e in edges.values())} import edges, {len(big)} circles')
for c in big:
    print(' circle:', ' '.join(sorted(c)))
    for a in sorted(c):
        print('   ', a, '->', ', '.join(sorted(t for t in edges[a] if t in c)))
glob = [m for m, p in files.items() if re.search(r'use super::\*;', open(p).read())]
print(f'{len(glob)} files with use super::*')
