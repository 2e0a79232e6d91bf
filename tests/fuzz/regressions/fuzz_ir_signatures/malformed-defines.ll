define void @a(ptr %x, i32 %n, ptr %late) {
define void @b((((((
define @
define void @c(ptr %x