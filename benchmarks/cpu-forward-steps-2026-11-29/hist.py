import re,collections,sys
base=int(open('/tmp/prof/jit.base').read(),16)
size=len(open('/tmp/prof/jit.bin','rb').read())
ips=[]
tot=0
for l in open('/tmp/prof/ips.txt'):
    c,ip=l.split(); c=int(c); ip=int(ip,16); tot+=c
    if base<=ip<base+size: ips.append((ip,c))
inside=sum(c for _,c in ips)
print('samples',tot,'in region',inside)
asm={}
for l in open('/tmp/prof/jit.asm'):
    m=re.match(r'\s*([0-9a-f]+):\s+(?:[0-9a-f]{2} )+\s*(\S+)',l)
    if m: asm[int(m.group(1),16)]=m.group(2)
hist=collections.Counter()
for ip,c in ips: hist[asm.get(ip,'?')]+=c
for k,v in hist.most_common(16): print(f'{k:12s} {v:6d} {100*v/inside:5.1f}%')
